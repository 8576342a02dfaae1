"""GPT-Neo: per layer, ``attn.attention.{q,k,v}_proj`` column parallel and ``out_proj`` row parallel
(the attention's head count follows the shard), ``mlp.c_fc`` column and ``mlp.c_proj`` row
parallel, bias + activation of ``c_fc`` fused with ``fuse=True``. Embeddings stay whole."""

from __future__ import annotations

from ._base import finish, fuse_bias_act, prepare, register_head_count_rule, shard_block
from .registry import register_schedule

__all__ = ["apply"]

register_head_count_rule("GPTNeoSelfAttention", "q_proj", "num_heads", "head_dim")


@register_schedule()
def apply(model, **sch_config):
    sch = prepare(model, sch_config, "gpt_neo")
    base = sch["transformer"] if "transformer" in sch.child else sch
    layers = list(base["h"].child.values())
    with sch.atomic():
        for layer in layers:
            if sch_config.get("fuse", False):
                fuse_bias_act(layer["mlp"], "c_fc", "act")
            if sch.world_size > 1:
                shard_block(layer["attn.attention"], ["q_proj", "k_proj", "v_proj"], "out_proj")
                shard_block(layer["mlp"], ["c_fc"], "c_proj")
    return finish(sch, "gpt_neo", layers, sch_config)

"""GPT-Neo: per layer, ``attn.attention.{q,k,v}_proj`` column parallel and ``out_proj`` row parallel
(the attention's head count follows the shard), ``mlp.c_fc`` column and ``mlp.c_proj`` row
parallel, bias + activation of ``c_fc`` fused with ``fuse=True``. Embeddings stay whole."""

from __future__ import annotations

from ._base import finish, prepare, register_head_count_rule, schedule_layers
from .registry import register_schedule

__all__ = ["apply"]

register_head_count_rule("GPTNeoSelfAttention", "q_proj", "num_heads", "head_dim")


@register_schedule()
def apply(model, **sch_config):
    sch = prepare(model, sch_config, "gpt_neo")
    base = sch["transformer"] if "transformer" in sch.child else sch
    layers = list(base["h"].child.values())
    schedule_layers(sch, layers, sch_config, attention=("attn.attention", ["q_proj", "k_proj", "v_proj"], "out_proj"),
                    mlp=("mlp", ["c_fc"], "c_proj"), fuse=("mlp", "c_fc", "act"))
    return finish(sch, "gpt_neo", layers, sch_config)

"""OPT: per decoder layer, ``self_attn.{q,k,v}_proj`` column parallel and ``out_proj`` row parallel
(the head count follows the shard, through the generic attention rule), ``fc1`` column and ``fc2`` row parallel, bias + activation of
``fc1`` fused with ``fuse=True``. Embeddings and the LM head stay whole."""

from __future__ import annotations

from ._base import finish, fuse_bias_act, prepare, shard_block, shard_column, shard_row
from .registry import register_schedule

__all__ = ["apply"]

@register_schedule()
def apply(model, **sch_config):
    sch = prepare(model, sch_config, "opt")
    base = sch["model"] if "model" in sch.child else sch
    layers = list(base["decoder.layers"].child.values())
    with sch.atomic():
        for layer in layers:
            if sch_config.get("fuse", False):
                fuse_bias_act(layer, "fc1", "activation_fn")
            if sch.world_size > 1:
                shard_block(layer["self_attn"], ["q_proj", "k_proj", "v_proj"], "out_proj")
                shard_column(layer["fc1"])
                shard_row(layer["fc2"])
    return finish(sch, "opt", layers, sch_config)

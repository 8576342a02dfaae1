"""OPT: per decoder layer, ``self_attn.{q,k,v}_proj`` column parallel and ``out_proj`` row parallel
(the head count follows the shard, through the generic attention rule), ``fc1`` column and ``fc2`` row parallel, bias + activation of
``fc1`` fused with ``fuse=True``. Embeddings and the LM head stay whole."""

from __future__ import annotations

from ._base import finish, prepare, schedule_layers
from .registry import register_schedule

__all__ = ["apply"]

@register_schedule()
def apply(model, **sch_config):
    sch = prepare(model, sch_config, "opt")
    base = sch["model"] if "model" in sch.child else sch
    layers = list(base["decoder.layers"].child.values())
    schedule_layers(sch, layers, sch_config, attention=("self_attn", ["q_proj", "k_proj", "v_proj"], "out_proj"),
                    mlp=("", ["fc1"], "fc2"), fuse=("", "fc1", "activation_fn"))
    return finish(sch, "opt", layers, sch_config)

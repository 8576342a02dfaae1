"""ALBERT: its layers share weights (``albert_layer_groups.*.albert_layers.*`` run
``num_hidden_layers`` times), so each shared layer is sharded once: q, k, v column parallel and
the attention's ``dense`` row parallel; ``ffn`` column and ``ffn_output`` row parallel; bias +
activation of ``ffn`` fused with ``fuse=True``. Embeddings stay whole."""

from __future__ import annotations

from ._base import finish, prepare, schedule_layers
from .registry import register_schedule

__all__ = ["apply", "shared_layers"]


def shared_layers(sch):
    base = sch["albert"] if "albert" in sch.child else sch
    groups = base["encoder.albert_layer_groups"]
    return [layer for group in groups.child.values() for layer in group["albert_layers"].child.values()]


@register_schedule()
def apply(model, **sch_config):
    sch = prepare(model, sch_config, "albert")
    layers = shared_layers(sch)
    schedule_layers(sch, layers, sch_config, attention=("attention", ["query", "key", "value"], "dense"),
                    mlp=("", ["ffn"], "ffn_output"), fuse=("", "ffn", "activation"))
    return finish(sch, "albert", layers, sch_config)

"""ALBERT: its layers share weights (``albert_layer_groups.*.albert_layers.*`` run
``num_hidden_layers`` times), so each shared layer is sharded once: q, k, v column parallel and
the attention's ``dense`` row parallel; ``ffn`` column and ``ffn_output`` row parallel; bias +
activation of ``ffn`` fused with ``fuse=True``. Embeddings stay whole."""

from __future__ import annotations

from ._base import finish, fuse_bias_act, prepare, shard_block, shard_column, shard_row
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
    with sch.atomic():
        for layer in layers:
            if sch_config.get("fuse", False):
                fuse_bias_act(layer, "ffn", "activation")
            if sch.world_size > 1:
                shard_block(layer["attention"], ["query", "key", "value"], "dense")
                shard_column(layer["ffn"])
                shard_row(layer["ffn_output"])
    return finish(sch, "albert", layers, sch_config)

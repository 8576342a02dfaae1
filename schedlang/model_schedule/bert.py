"""BERT (``BertForMaskedLM`` / ``BertModel``): bias + GELU of the intermediate projection fused
(``fuse=True``), :func:`schedlang.models.shard_bert` (heads, MLP, vocabulary-parallel embeddings
and decoder) and checkpointing."""

from __future__ import annotations

from ._base import finish, fuse_bias_act, prepare
from .registry import register_schedule

__all__ = ["apply", "encoder_layers"]


def encoder_layers(sch):
    """The schedules of the encoder layers of a BERT-like model (``encoder.layer``)."""
    frontier = [sch]
    for _ in range(3):
        for s in frontier:
            if "encoder" in s.child and "layer" in s["encoder"].child:
                return list(s["encoder.layer"].child.values())
        frontier = [c for s in frontier for c in s.child.values()]
    raise ValueError(f"{sch.path or '<root>'}: {type(sch.mod).__name__} has no encoder.layer list")


@register_schedule()
def apply(model, **sch_config):
    from ..models import shard_bert

    sch = prepare(model, sch_config, "bert")
    layers = encoder_layers(sch)
    if sch_config.get("fuse", False):
        for layer in layers:
            fuse_bias_act(layer["intermediate"], "dense", "intermediate_act_fn")
    if sch.world_size > 1:
        shard_bert(sch, sequence_parallel=sch_config.get("sequence_parallel", False),
                   gather_logits=sch_config.get("gather_logits", True))
    return finish(sch, "bert", layers, sch_config)

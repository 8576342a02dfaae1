"""RoBERTa: BERT's encoder layout (``roberta.encoder.layer``). Each layer: q, k, v column parallel
and ``attention.output.dense`` row parallel, ``intermediate.dense`` column and ``output.dense``
row parallel; bias + GELU fused with ``fuse=True``; the word embeddings and the tied LM decoder are vocabulary
parallel (logits gathered unless ``gather_logits=False``)."""

from __future__ import annotations

from . import _helpers
from ._base import finish, fuse_bias_act, prepare, shard_block, shard_column, shard_row
from .bert import encoder_layers
from .registry import register_schedule

__all__ = ["apply", "shard_encoder_layer"]


def shard_encoder_layer(layer) -> None:
    shard_block(layer["attention"], ["self.query", "self.key", "self.value"], "output.dense")
    shard_column(layer["intermediate.dense"])
    shard_row(layer["output.dense"])


@register_schedule()
def apply(model, **sch_config):
    sch = prepare(model, sch_config, "roberta")
    layers = encoder_layers(sch)
    with sch.atomic():
        for layer in layers:
            if sch_config.get("fuse", False):
                fuse_bias_act(layer["intermediate"], "dense", "intermediate_act_fn")
            if sch.world_size > 1:
                shard_encoder_layer(layer)
        if sch.world_size > 1:
            base = sch["roberta"] if "roberta" in sch.child else sch
            _helpers.shard_vocabulary(sch, f"{base.path}.embeddings.word_embeddings" if base.path else
                                      "embeddings.word_embeddings", "lm_head.decoder", sch_config)
    return finish(sch, "roberta", layers, sch_config)

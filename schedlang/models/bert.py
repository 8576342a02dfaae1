"""Tensor-parallel schedule for HF BERT (``BertForMaskedLM`` / ``BertModel``, transformers 5.x).

================================  ========================  ======================================
module                            shard                     sync (tensor parallel)
================================  ========================  ======================================
``attention.self.{query,key,      weight, bias axis 0       ``attention.self``: bwd_post all_reduce
value}``
``attention.output.dense``        weight axis 1             fwd_post all_reduce (bias added after)
``intermediate.dense``            weight, bias axis 0       ``intermediate``: bwd_post all_reduce
``output.dense``                  weight axis 1             fwd_post all_reduce
``embeddings.word_embeddings``    weight axis 0             fwd_post all_reduce
``cls.predictions.decoder``       (tied) weight, bias ax 0  bwd_post all_reduce; logits stay split
================================  ========================  ======================================

The decoder's weight is tied to the word embeddings and its bias to ``cls.predictions.bias``:
both ties are kept. Position and token-type embeddings, the pooler and the MLM transform stay
whole. ``BertForMaskedLM`` computes its loss with ``CrossEntropyLoss`` over the full vocabulary,
so with split logits compute the loss with
:func:`~schedlang.distributed.cross_entropy.vocab_parallel_cross_entropy`, or pass
``gather_logits=True`` to keep HF's loss.

With ``sequence_parallel=True`` (post-LN layout) each encoder layer's input, residuals,
dropouts and LayerNorms stay split along the sequence: the attention and the intermediate
projection all-gather their input along the sequence, the two row-parallel projections
reduce-scatter theirs, and the encoder's output is all-gathered before the MLM head.

Example::

    sch = schedlang.create_schedule(BertForMaskedLM(config))
    shard_bert(sch)
    logits = schedlang.build(sch)[0](input_ids=ids).logits     # (batch, seq, vocab / world)
    loss = vocab_parallel_cross_entropy(logits, labels)
"""

from __future__ import annotations

from ._common import (SEQUENCE_AXIS, base_and_prefix, finish_lm_head, model_schedule, shard_column, shard_row,
                      shard_vocab_embedding)

__all__ = ["shard_bert"]


@model_schedule
def shard_bert(sch, sequence_parallel: bool = False, gather_logits: bool = False):
    """Write the tensor-parallel steps for a HF BERT model into ``sch``; returns ``sch``.

    Arguments:
        sch: schedule of a ``BertForMaskedLM`` or ``BertModel``.
        sequence_parallel: split the encoder's residual stream along the sequence.
        gather_logits: all-gather the MLM logits along the vocabulary (HF's loss works, ``Verify``
            compares them); by default they stay split.

    Example::

        with schedlang.Verify(sch, example_inputs=[ids]):
            shard_bert(sch, gather_logits=True)
    """
    encoder, _ = base_and_prefix(sch, "layer", "BERT")
    first = None
    for name, layer in encoder["layer"].child.items():
        first = first or layer
        attn_self, attn_out = layer["attention.self"], layer["attention.output"]
        for n in ("query", "key", "value"):
            shard_column(attn_self[n])
        shard_row(attn_out["dense"])
        shard_column(layer["intermediate.dense"])
        shard_row(layer["output.dense"])
        if sequence_parallel:
            attn_self.sync(mode="fwd_pre", sync_op_or_fn="all_gather", axis=SEQUENCE_AXIS,
                           tensor_parallel_output_grad=False)
            attn_out["dense"].sync(mode="fwd_post", sync_op_or_fn="reduce_scatter", axis=SEQUENCE_AXIS)
            layer["intermediate"].sync(mode="fwd_pre", sync_op_or_fn="all_gather", axis=SEQUENCE_AXIS,
                                       tensor_parallel_output_grad=False)
            layer["output.dense"].sync(mode="fwd_post", sync_op_or_fn="reduce_scatter", axis=SEQUENCE_AXIS)
        else:
            attn_self.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
            attn_out["dense"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
            layer["intermediate"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
            layer["output.dense"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    embeddings = _find(sch, "embeddings")
    if embeddings is not None:
        shard_vocab_embedding(embeddings["word_embeddings"])
    if sequence_parallel:
        from ..distributed.sequence_parallel import sequence_parallel_norms, split_sequence

        split_sequence(first, axis=SEQUENCE_AXIS)
        sequence_parallel_norms(encoder, type(first["output.LayerNorm"].mod))
        encoder.sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=SEQUENCE_AXIS)
    if "cls.predictions.decoder" in sch:
        finish_lm_head(sch, sch, "", False, gather_logits, head_path="cls.predictions.decoder",
                       install_loss=False)
    return sch


def _find(sch, name: str):
    """The first schedule named ``name`` at most two levels down (``bert.embeddings`` or ``embeddings``)."""
    if name in sch.child:
        return sch[name]
    for child in sch.child.values():
        if name in child.child:
            return child[name]
    return None

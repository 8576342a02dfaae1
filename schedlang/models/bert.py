"""Tensor parallelism for HF BERT (``BertForMaskedLM`` / ``BertModel``, transformers 5.x): the automatic plan
(:mod:`schedlang.models.auto`) over BERT's blocks, which BERT's own code spreads over several modules.

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

The attention's q/k/v live in ``attention.self`` and its output projection in ``attention.output``,
the MLP's two projections in ``intermediate`` and ``output``: no module's forward calls both halves
of a pair, so the blocks are named here (:func:`~schedlang.models.auto.layer_plan`) instead of found
by dataflow; everything else is the automatic plan. The decoder's weight is tied to the word
embeddings and its bias to ``cls.predictions.bias``: both ties are kept. Position and token-type
embeddings, the pooler and the MLM transform stay whole. ``BertForMaskedLM`` computes its loss
with ``CrossEntropyLoss`` over the full vocabulary (an encoder-only head: no ``loss_function`` to
replace), so with split logits compute the loss with
:func:`~schedlang.distributed.cross_entropy.vocab_parallel_cross_entropy`, or pass
``gather_logits=True`` to keep HF's loss.

With ``sequence_parallel=True`` (post-LN layout) each encoder layer's input, residuals,
dropouts and LayerNorms stay split along the sequence: ``attention.self`` and ``intermediate``
all-gather their input along the sequence, the two row-parallel projections reduce-scatter
theirs, and the last layer's output is all-gathered before the MLM head.

Example::

    sch = schedlang.create_schedule(BertForMaskedLM(config))
    shard_bert(sch)
    logits = schedlang.build(sch)[0](input_ids=ids).logits     # (batch, seq, vocab / world)
    loss = vocab_parallel_cross_entropy(logits, labels)
"""

from __future__ import annotations

from ._common import base_and_prefix, model_schedule
from .auto import BlockPlan, TensorParallelPlan, apply_tensor_parallel, check_family_layout, layer_plan

__all__ = ["shard_bert"]

#: block (under each encoder layer; "": the layer) -> (column projections, row projection)
BERT_BLOCKS = {"attention": (["self.query", "self.key", "self.value"], "output.dense"),
               "": (["intermediate.dense"], "output.dense")}


@model_schedule
def shard_bert(sch, sequence_parallel: bool = False, gather_logits: bool = False) -> TensorParallelPlan:
    """Write the tensor-parallel steps for a HF BERT model into ``sch``; returns the plan applied.

    Arguments:
        sch: schedule of a ``BertForMaskedLM`` or ``BertModel``.
        sequence_parallel: split the encoder's residual stream along the sequence; the sequence
            length must be divisible by the number of ranks.
        gather_logits: all-gather the MLM logits along the vocabulary (HF's loss works, ``Verify``
            compares them); by default they stay split.

    Example::

        with schedlang.Verify(sch, example_inputs=[ids]):
            shard_bert(sch, gather_logits=True)
    """
    check_family_layout(sch, "BERT", "layer", BERT_BLOCKS)
    encoder, _ = base_and_prefix(sch, "layer", "BERT")
    layers_path = ".".join(p for p in (encoder.path[len(sch.path):].lstrip("."), "layer") if p)
    blocks = []
    for name in encoder["layer"].child:
        for block, (columns, row) in BERT_BLOCKS.items():
            # the block's input enters at the module holding its columns (attention.self, intermediate)
            blocks.append(BlockPlan(".".join(p for p in (layers_path, name, block) if p),
                                    "attention" if block else "mlp", list(columns), row, "block",
                                    entry=columns[0].rpartition(".")[0]))
    plan = layer_plan(sch, layers_path, blocks, gather_logits=gather_logits, sequence_parallel=sequence_parallel)
    plan.schedule, plan.vocab_parallel_loss = "shard_bert", False
    return apply_tensor_parallel(sch, plan)

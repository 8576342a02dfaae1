"""Tensor parallelism for HF GPT-2 (``GPT2LMHeadModel`` / ``GPT2Model``, transformers 5.x): the automatic
plan (:mod:`schedlang.models.auto`), with a check of GPT-2's layout.

GPT-2's projections are HF ``Conv1D`` layers (weight stored as (in, out)), and attention uses
one fused projection ``c_attn`` for q | k | v. The plan:

==========================  ===============================  =====================================
module                      shard                            sync (tensor parallel)
==========================  ===============================  =====================================
``attn.c_attn``             weight axis 1, bias axis 0,      ``attn``: bwd_post all_reduce
                            head-wise: rank r has q_r|k_r|v_r
``attn.c_proj``             weight axis 0 (bias after sync)  fwd_post all_reduce
``mlp.c_fc``                weight axis 1, bias axis 0       ``mlp``: bwd_post all_reduce
``mlp.c_proj``              weight axis 0                    fwd_post all_reduce
``wte`` (tied ``lm_head``)  weight axis 0                    fwd_post all_reduce; LM head bwd_post
==========================  ===============================  =====================================

``c_attn``'s head-wise split comes from GPT2Attention's shard rule (a plain split of the
3 * hidden outputs would give rank 0 all of q); the rule also sets ``split_size`` and
``num_heads`` to the local values. The LM head shares its weight with ``wte``: sharding one
shards both, and the tie is kept. Position embeddings ``wpe`` stay whole. Blocks with
cross-attention are refused.

With ``sequence_parallel=True``, ``ln_1`` / ``ln_2`` and the residual dropouts run on sequence
slices (see :mod:`schedlang.distributed.sequence_parallel`).

Example::

    sch = schedlang.create_schedule(GPT2LMHeadModel(config))
    shard_gpt2(sch)
    model, opt = schedlang.build(sch, optimizer="adamw")
"""

from __future__ import annotations

from ..errors import ScheduleTypeError
from ._common import base_and_prefix, model_schedule
from .auto import TensorParallelPlan, apply_tensor_parallel, family_plan

__all__ = ["shard_gpt2"]

GPT2_BLOCKS = {"attn": (["c_attn"], "c_proj"), "mlp": (["c_fc"], "c_proj")}


@model_schedule
def shard_gpt2(sch, sequence_parallel: bool = False, gather_logits: bool = False) -> TensorParallelPlan:
    """Write the tensor-parallel steps for a HF GPT-2 model into ``sch``; returns the plan applied.

    Arguments:
        sch: schedule of a ``GPT2LMHeadModel`` or ``GPT2Model``.
        sequence_parallel: also split norms, residuals and dropouts along the sequence; the sequence
            length must be divisible by the number of ranks.
        gather_logits: all-gather the logits (full logits, HF's loss, comparable by ``Verify``); by
            default they stay split along the vocabulary and the loss is the vocabulary-parallel one.

    Example::

        with schedlang.Verify(sch, example_inputs=[ids]):
            shard_gpt2(sch, gather_logits=True)
    """
    base, _ = base_and_prefix(sch, "h", "GPT-2")
    for block in base["h"].child.values():
        if getattr(block["attn"].mod, "is_cross_attention", False) or "crossattention" in block.child:
            raise ScheduleTypeError(f"{block.path}: GPT-2 blocks with cross-attention are not supported by "
                                    "shard_gpt2; shard their projections step by step")
    plan = family_plan(sch, "GPT-2", "h", GPT2_BLOCKS, gather_logits=gather_logits,
                       sequence_parallel=sequence_parallel, name="shard_gpt2")
    return apply_tensor_parallel(sch, plan)

"""Tensor parallelism for HF LLaMA (``LlamaForCausalLM`` / ``LlamaModel``, transformers 5.x): the automatic
plan (:mod:`schedlang.models.auto`) with LLaMA's options.

The plan is Megatron-LM's layout, as the automatic plan finds it:

=====================================  ===================  ====================================
module                                 shard                sync (tensor parallel)
=====================================  ===================  ====================================
``self_attn.{q,k,v}_proj``             weight (+bias) ax 0  ``self_attn``: bwd_post all_reduce
``self_attn.o_proj``                   weight axis 1        fwd_post all_reduce
``mlp.{gate,up}_proj``                 weight axis 0        ``mlp``: bwd_post all_reduce
``mlp.down_proj``                      weight axis 1        fwd_post all_reduce
``embed_tokens``                       weight axis 0        fwd_post all_reduce (vocab parallel)
``lm_head``                            weight axis 0        bwd_post all_reduce; logits stay split
=====================================  ===================  ====================================

Each rank holds ``heads / world`` query and key/value heads (the generic shard rule checks that
they divide), ``intermediate / world`` MLP columns and ``vocab / world`` rows of the embedding
and the LM head. Logits stay split along the vocabulary and the loss is the vocabulary-parallel
cross entropy (:mod:`schedlang.distributed.cross_entropy`), unless ``gather_logits=True``.

What LLaMA adds to the automatic plan: a check that every layer holds LLaMA's projections,
``shard_embeddings=False``, and ``grad_sync="norm"``: the block inputs are synchronized at the
output of the RMSNorm in front of each block (a plain forward hook) instead of on the block's
keyword-only input. Under ``sequence_parallel=True`` the sequence is all-gathered at those norm
outputs too; the RMSNorms run on sequence slices (weight gradients summed over the group) and
``o_proj`` / ``down_proj`` reduce-scatter (see :mod:`schedlang.distributed.sequence_parallel`).

Example::

    sch = schedlang.create_schedule(model)        # on every rank (torchrun)
    shard_llama(sch, sequence_parallel=True)
    model, opt = schedlang.build(sch, optimizer=torch.optim.AdamW, lr=1e-4, fused=True)
    loss = model(input_ids=ids, labels=ids).loss  # vocabulary-parallel loss
"""

from __future__ import annotations

from ..errors import ScheduleValueError
from ._common import model_schedule
from .auto import TensorParallelPlan, apply_tensor_parallel, family_plan

__all__ = ["shard_llama"]

#: block -> (column projections, row projection) in every LLaMA layer, and the norm in front of the block
LLAMA_BLOCKS = {"self_attn": (["q_proj", "k_proj", "v_proj"], "o_proj"),
                "mlp": (["gate_proj", "up_proj"], "down_proj")}
NORM_BEFORE = {"self_attn": "input_layernorm", "mlp": "post_attention_layernorm"}


@model_schedule
def shard_llama(sch, sequence_parallel: bool = False, gather_logits: bool = False, shard_embeddings: bool = True,
                grad_sync: str = "block") -> TensorParallelPlan:
    """Write the tensor-parallel steps for a HF LLaMA model into ``sch``; returns the plan applied.

    Arguments:
        sch: schedule of a ``LlamaForCausalLM`` or ``LlamaModel`` (also Mistral / Qwen2, same layout).
        sequence_parallel: also split norms and residuals along the sequence (Megatron-SP); the
            sequence length must be divisible by the number of ranks.
        gather_logits: all-gather the logits along the vocabulary (full logits on every rank, HF's
            own loss, and what ``Verify`` compares); by default they stay split and the model's
            ``loss_function`` becomes the vocabulary-parallel one.
        shard_embeddings: split ``embed_tokens`` along the vocabulary (a tied LM head always is).
        grad_sync: where the gradient entering each attention and MLP block is all-reduced (tensor
            parallel only): ``"block"`` on the block's input (``sync(mode="bwd_post")``; HF calls the
            attention with keyword arguments, so this is a keyword pre-hook), or ``"norm"`` on the
            output of the norm in front of it (``AllReduceGradient``, a plain forward hook). Same
            arithmetic; ``"norm"`` keeps keyword pre-hooks out of ``torch.compile``'d layers.

    Example::

        with schedlang.Verify(sch, example_inputs=[ids]):
            shard_llama(sch, gather_logits=True)
    """
    if grad_sync not in ("block", "norm"):
        raise ScheduleValueError(f"shard_llama: invalid grad_sync {grad_sync!r}: valid are 'block', 'norm'")
    plan = family_plan(sch, "LLaMA", "layers", LLAMA_BLOCKS, gather_logits=gather_logits,
                       sequence_parallel=sequence_parallel, name="shard_llama")
    if grad_sync == "norm" or sequence_parallel:
        for block in plan.all_blocks:
            layer, _, name = block.path.rpartition(".")
            block.grad_sync, block.producer = "producer", f"{layer}.{NORM_BEFORE[name]}"
    if not shard_embeddings and plan.embedding and not _tied(sch, plan):
        plan.embedding = None
    return apply_tensor_parallel(sch, plan)


def _tied(sch, plan) -> bool:
    root = sch.root
    return plan.lm_head is not None and root[plan.lm_head].mod.weight is root[plan.embedding].mod.weight

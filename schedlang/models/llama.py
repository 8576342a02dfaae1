"""Tensor-parallel schedule for HF LLaMA (``LlamaForCausalLM`` / ``LlamaModel``, transformers 5.x).

Megatron-LM's layout, written as ``shard`` / ``sync`` steps:

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

Each rank holds ``heads / world`` query and key/value heads (the attention rule checks that
they divide), ``intermediate / world`` MLP columns and ``vocab / world`` rows of the embedding
and the LM head. Logits stay split along the vocabulary and the loss is the vocabulary-parallel
cross entropy (:mod:`schedlang.distributed.cross_entropy`), unless ``gather_logits=True``.

With ``sequence_parallel=True`` the activations between the parallel regions are split along
the sequence (see :mod:`schedlang.distributed.sequence_parallel`): the first decoder layer
keeps its slice of the sequence, every RMSNorm runs on sequence shards (gradients of their
weights summed over the group), its output is all-gathered along the sequence before the
projections, and ``o_proj`` / ``down_proj`` reduce-scatter along the sequence.

Example::

    sch = schedlang.create_schedule(model)        # on every rank (torchrun)
    shard_llama(sch, sequence_parallel=True)
    model, opt = schedlang.build(sch, optimizer=torch.optim.AdamW, lr=1e-4, fused=True)
    loss = model(input_ids=ids, labels=ids).loss  # vocabulary-parallel loss
"""

from __future__ import annotations

from ..errors import ScheduleTypeError, ScheduleValueError
from ._common import (base_and_prefix, finish_lm_head, model_schedule, shard_linear_pair, shard_vocab_embedding,
                      split_sequence_at)

__all__ = ["shard_llama"]


@model_schedule
def shard_llama(sch, sequence_parallel: bool = False, gather_logits: bool = False, shard_embeddings: bool = True,
                grad_sync: str = "block"):
    """Write the tensor-parallel steps for a HF LLaMA model into ``sch``; returns ``sch``.

    Arguments:
        sch: schedule of a ``LlamaForCausalLM`` or ``LlamaModel`` (also Mistral / Qwen2, same layout).
        sequence_parallel: also split norms and residuals along the sequence (Megatron-SP).
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
    base, prefix = base_and_prefix(sch, "layers", "LLaMA")
    layers = base["layers"]
    first = None
    for name, layer in layers.child.items():
        first = first or layer
        attn, mlp = layer["self_attn"], layer["mlp"]
        if not all(n in attn.child for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise ScheduleTypeError(f"{attn.path}: expected q_proj, k_proj, v_proj and o_proj in a LLaMA attention, "
                                    f"found {', '.join(attn.child) or 'no submodules'}")
        at_norm = grad_sync == "norm"
        shard_linear_pair(layer, attn, ["q_proj", "k_proj", "v_proj"], "o_proj", sequence_parallel,
                          norm="input_layernorm", grad_sync_at_norm=at_norm)
        shard_linear_pair(layer, mlp, ["gate_proj", "up_proj"], "down_proj", sequence_parallel,
                          norm="post_attention_layernorm", grad_sync_at_norm=at_norm)
    if shard_embeddings or _lm_head_tied(sch, base):
        shard_vocab_embedding(base["embed_tokens"])
    if sequence_parallel:
        from ..distributed.sequence_parallel import sequence_parallel_norms

        split_sequence_at(first)
        sequence_parallel_norms(base, type(base["norm"].mod))
    finish_lm_head(sch, base, "norm", sequence_parallel, gather_logits)
    return sch


def _lm_head_tied(sch, base) -> bool:
    return "lm_head" in sch.child and sch["lm_head"].mod.weight is base["embed_tokens"].mod.weight

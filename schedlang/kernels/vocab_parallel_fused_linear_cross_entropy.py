"""Vocabulary-parallel linear + cross entropy, chunked over tokens (Triton statistics and gradient).

Rank r of ``group`` holds rows ``[r V/w, (r+1) V/w)`` of the LM head weight (a column-parallel
head); the hidden states are the same on every rank. Per chunk of ``C`` tokens each rank makes
only its ``C x V/w`` logits, and the softmax statistics are combined over the ranks::

    m_r, s_r, t_r = max_j z_j, sum_j exp(z_j - m_r), z_target (0 off this slice)   # Triton, one pass
    m   = all_reduce_max(m_r)
    s,t = all_reduce_sum(s_r exp(m_r - m), t_r)                                    # one collective
    lse = m + log(s);  loss = lse - t
    z  <- softmax(z) - onehot(target)   for this slice's columns, in place         # Triton

then, as in the single-device kernel (:mod:`fused_linear_cross_entropy`), ``dx += z W_r`` and
``dW_r += z^T x`` chunk by chunk in the forward pass. ``dx`` of a slice is a partial sum over the
vocabulary: with ``reduce_hidden_grad`` (default) it is all-reduced once, at the end of the
loop, so the returned gradient of ``hidden`` is the full one. Pass ``False`` when the schedule
already all-reduces the LM head input's gradient (a ``bwd_post`` sync on a column-parallel head),
to avoid summing twice.

Collectives per chunk: two all-reduces of ``C`` and ``2 C`` fp32 values; the logits never leave the
rank. Vocabulary slices must be equal (``V`` divisible by the world size, as ``shard`` makes them).

Example::

    w_shard = lm_head.weight.chunk(world)[rank]
    loss = vocab_parallel_fused_linear_cross_entropy(hidden, w_shard, labels, group)
"""

from __future__ import annotations

from typing import Optional

import torch

from schedlang.kernels.fused_linear_cross_entropy import LinearCrossEntropy, _group_size, check_arguments
from schedlang.kernels.row_kernels import use_triton_for
from schedlang.kernels.vocab_parallel_fused_linear_cross_entropy_reference import (
    vocab_parallel_fused_linear_cross_entropy_reference)

__all__ = ["vocab_parallel_fused_linear_cross_entropy", "reference"]

reference = vocab_parallel_fused_linear_cross_entropy_reference


def vocab_parallel_fused_linear_cross_entropy(
        hidden: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor, group=None,
        ignore_index: int = -100, reduction: str = "mean", chunk_size: Optional[int] = None,
        bias_shard: Optional[torch.Tensor] = None, reduce_hidden_grad: bool = True) -> torch.Tensor:
    """Cross entropy of ``hidden @ W^T (+ b)`` where this rank holds the rows ``weight_shard`` (and
    ``bias_shard``) of ``W`` for its slice of the vocabulary; equals ``F.cross_entropy`` of the full
    logits on every rank. ``target`` holds ids of the full vocabulary, the same on every rank.

    The gradient of ``weight_shard`` is this slice's rows of the full gradient; that of ``hidden``
    the full gradient (see ``reduce_hidden_grad`` in the module notes). ``group=None`` (or one
    rank) is the whole vocabulary, as :func:`fused_linear_cross_entropy`. Runs the Triton kernels on
    CUDA (and on the CPU under ``TRITON_INTERPRET=1``), else :func:`reference`.

    Example::

        loss = vocab_parallel_fused_linear_cross_entropy(hidden, w_shard, labels, group=tp_group)
    """
    # target ids name the whole vocabulary: this rank checks them against its slice's rows times the number of
    # slices (equal slices, as the kernel needs), which it knows without asking the other ranks
    check_arguments("vocab_parallel_fused_linear_cross_entropy", hidden, weight_shard, target, reduction,
                    chunk_size, bias_shard, ignore_index, vocab_slices=_group_size(group))
    if (not use_triton_for(hidden, weight_shard, bias_shard) or hidden.dtype != weight_shard.dtype
            or target.device != hidden.device):
        return reference(hidden, weight_shard, target, group, ignore_index, reduction, chunk_size, bias_shard,
                         reduce_hidden_grad)
    return LinearCrossEntropy.apply(hidden, weight_shard, bias_shard, target, ignore_index, reduction, chunk_size,
                                    group, reduce_hidden_grad)

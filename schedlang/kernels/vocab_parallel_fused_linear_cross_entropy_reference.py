"""Vocabulary-parallel linear + cross entropy in plain PyTorch: each rank's logit slice is made
whole-sized in no memory, but materialized for its own slice (``tokens x V / world``).

The hidden states are replicated; rank r holds rows ``[r V/w, (r+1) V/w)`` of the LM head weight::

    z_r  = hidden @ W_r^T (+ b_r)                           # this rank's logit columns, then fp32
    loss = vocab_parallel_cross_entropy(z_r, target, group)  # statistics all-reduced over the group

With ``reduce_hidden_grad`` the partial gradients of ``hidden`` (one per slice) are summed over
the group in backward, so every rank gets the full gradient of the replicated input.

Example::

    loss = vocab_parallel_fused_linear_cross_entropy_reference(hidden, w_shard, labels, group)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["vocab_parallel_fused_linear_cross_entropy_reference"]


def vocab_parallel_fused_linear_cross_entropy_reference(
        hidden: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor, group=None,
        ignore_index: int = -100, reduction: str = "mean", chunk_size: Optional[int] = None,
        bias_shard: Optional[torch.Tensor] = None, reduce_hidden_grad: bool = True) -> torch.Tensor:
    """Cross entropy of ``hidden @ W^T`` with ``W`` split by rows (vocabulary) over ``group``;
    equals ``F.cross_entropy`` of the full logits (``chunk_size`` is accepted and ignored)."""
    from schedlang.distributed.collectives import reduce_backward
    from schedlang.distributed.cross_entropy import vocab_parallel_cross_entropy

    if reduce_hidden_grad:
        hidden = reduce_backward(hidden, group)
    logits = F.linear(hidden, weight_shard, bias_shard).float()
    return vocab_parallel_cross_entropy(logits, target, group=group, ignore_index=ignore_index, reduction=reduction)

"""Linear layer + cross entropy in plain PyTorch, as HF's causal-LM loss computes it.

The logits are computed in the weight's dtype and upcast to fp32 before the loss (HF's
``ForCausalLMLoss`` does ``logits.float()``)::

    loss = cross_entropy(float(hidden @ weight^T + bias), target, ignore_index, reduction)

This materializes all ``tokens x vocab`` logits (and their fp32 copy and gradient): it is the
reference the chunked kernel is tested against, and what CPU users run.

Example::

    loss = fused_linear_cross_entropy_reference(hidden, lm_head.weight, labels)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["fused_linear_cross_entropy_reference"]


def fused_linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                         ignore_index: int = -100, reduction: str = "mean",
                                         chunk_size: Optional[int] = None,
                                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), target)`` over the flattened tokens
    (``chunk_size`` is accepted for the same signature and ignored). ``reduction="none"`` gives a
    loss of ``target``'s shape."""
    logits = F.linear(hidden, weight, bias).float()
    # cross_entropy takes class ids as int64 only; the Triton kernels read any integer dtype (int32 too)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1).long(), ignore_index=ignore_index,
                           reduction=reduction)
    return loss.view(target.shape) if reduction == "none" else loss

"""Cross entropy of logits split along the vocabulary, with Slapo's signature.

Built on :func:`schedlang.distributed.cross_entropy.vocab_parallel_cross_entropy` (the exact
loss and gradient, three all-reduces of ``tokens`` values). ``vocab_parallel_cross_entropy``
here returns the loss of every token (``reduction="none"``) as Slapo's did, and adds label
smoothing: ``(1 - eps) * nll + eps * (logsumexp(z) - mean(z))``, whose two vocabulary sums are
all-reduced as well.

Example::

    loss_fn = ParallelCrossEntropy(group=tp_group)
    loss = loss_fn(local_logits, labels).mean()
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import collectives as _c
from ..distributed.cross_entropy import vocab_parallel_cross_entropy as _exact
from ..distributed.groups import world_size as _world_size
from ..errors import ScheduleValueError

__all__ = ["vocab_range_from_per_partition_vocab_size", "vocab_parallel_cross_entropy", "ParallelCrossEntropy"]


def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int, world_size=None
                                              ) -> Tuple[int, int]:
    """``[first, last)`` vocabulary ids held by ``rank`` when each rank holds ``per_partition_vocab_size``."""
    first = rank * per_partition_vocab_size
    return first, first + per_partition_vocab_size


def _smoothing_term(logits: torch.Tensor, group) -> torch.Tensor:
    """``logsumexp(z) - mean(z)`` over the whole vocabulary, per token, differentiable."""
    wide = logits.float()
    vocab = wide.shape[-1] * _world_size(group)
    with torch.no_grad():
        top = wide.max(dim=-1).values
        if _world_size(group) > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sum_exp = _c.reduce_forward((wide - top.unsqueeze(-1)).exp().sum(-1), group)
    total = _c.reduce_forward(wide.sum(-1), group)
    return sum_exp.log() + top - total / vocab


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, group=None, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross entropy of ``(..., V / world)`` local logits against full-vocabulary labels
    ``(...)``; equals ``F.cross_entropy(full_logits, target, reduction="none",
    label_smoothing=...)``. Tokens labelled ``ignore_index`` get 0."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ScheduleValueError(f"vocab_parallel_cross_entropy: label_smoothing must be in [0, 1), got "
                                 f"{label_smoothing}")
    nll = _exact(vocab_parallel_logits, target, group=group, ignore_index=ignore_index, reduction="none")
    if label_smoothing == 0.0:
        return nll
    smooth = _smoothing_term(vocab_parallel_logits, group).to(nll.dtype)
    smooth = smooth.masked_fill(target.to(smooth.device) == ignore_index, 0.0)
    return (1.0 - label_smoothing) * nll + label_smoothing * smooth


class ParallelCrossEntropy(nn.Module):
    """``forward(logits, labels)``: :func:`vocab_parallel_cross_entropy` over ``group``, per token."""

    def __init__(self, group=None, label_smoothing: float = 0.0, ignore_index: int = -100):
        super().__init__()
        self.group, self.label_smoothing, self.ignore_index = group, label_smoothing, ignore_index

    def forward(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(outputs, labels, self.label_smoothing, self.group, self.ignore_index)

"""Grouped matrix product in plain PyTorch: one matmul per group of rows, autograd's backward.

The rows of ``x`` come grouped: the first ``counts[0]`` rows belong to group (expert) 0, the next
``counts[1]`` to group 1, and so on; a group may have no rows. Each group is multiplied by its own
matrix::

    out[rows of e] = x[rows of e] @ w[e]          w [E, K, N]
    out[rows of e] = x[rows of e] @ w[e].T        w [E, N, K], transposed=True (nn.Linear's layout)

The transposed form calls ``F.linear`` per group, as transformers' expert loops do, so the result has
the same bits as the family's own loop on the same rows.

Example::

    out = grouped_mm_reference(x, w, torch.tensor([3, 0, 5]))     # x [8, K], w [3, K, N]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["grouped_mm_reference"]


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                         transposed: bool = False) -> torch.Tensor:
    """``[M, N]``: each group's rows of ``x`` [M, K] times its matrix of ``w``; ``counts`` [E] the rows of each
    group, in order, summing to M."""
    n = w.shape[1] if transposed else w.shape[2]
    sizes = [int(c) for c in counts.tolist()]
    pieces = [F.linear(rows, w[e]) if transposed else rows @ w[e]
              for e, rows in enumerate(x.split(sizes)) if sizes[e]]
    if not pieces:
        # no rows at all: an empty output that still depends on both inputs, so that their gradients are
        # zeros rather than missing (a group of no rows among others gets zeros from indexing ``w``)
        return x.new_zeros((0, n)) + (x.sum() + w.sum()).to(x.dtype) * 0
    return torch.cat(pieces)

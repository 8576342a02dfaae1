"""Token embedding (a row lookup) in plain PyTorch: ``nn.Embedding``'s forward and autograd's backward.

::

    out[..., :]    = weight[ids[...], :]
    grad_weight[v] = sum of grad_out[p] over the positions p with ids[p] == v (zeros where none,
                     and for the row ``padding_idx``)

Example::

    out = embedding_reference(torch.tensor([[1, 2, 2]]), weight, padding_idx=0)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["embedding_reference"]


def embedding_reference(ids: torch.Tensor, weight: torch.Tensor, padding_idx: Optional[int] = None) -> torch.Tensor:
    """``weight[ids]`` of shape ``ids.shape + (embedding_dim,)``; the row ``padding_idx`` (negative counts
    from the end, as in ``nn.Embedding``) gets no gradient."""
    return F.embedding(ids, weight, padding_idx=padding_idx)

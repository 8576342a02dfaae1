"""Batched operators that the horizontal rules put into graphs.

Each works on a *grouped tensor*: N same-shape pieces stacked along ``group_dim``
(piece ``i`` is ``x.select(group_dim, i)``), so one launch does the work of N. They
are plain PyTorch, differentiable, and readable in a printed graph; they take the
number of dimensions from the tensor at run time, so a graph without shape metadata
can use them.

Example::

    x = torch.randn(8, 3, 16)                      # 3 pieces of shape (8, 16)
    w, b = torch.randn(3, 16), torch.randn(3, 16)  # one affine pair per piece
    y = group_layer_norm(x, (16,), w, b, 1e-5, -2)
    torch.testing.assert_close(y[:, 1], F.layer_norm(x[:, 1], (16,), w[1], b[1]))
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["group_layer_norm", "batched_linear", "merge_group_dim"]


def group_layer_norm(x: torch.Tensor, normalized_shape: Sequence[int], weight: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], eps: float, group_dim: int) -> torch.Tensor:
    """N layer norms in one: normalize the last dims of ``x``, then piece ``i`` gets ``weight[i]``, ``bias[i]``.

    ``weight``/``bias`` have shape ``(N, *normalized_shape)``; ``group_dim`` must lie before
    the normalized dims. One normalization kernel plus one fused multiply-add
    (``torch.addcmul``) whatever N is, instead of N layer-norm kernels (for float16/bfloat16
    inputs also a cast to float32 and back, to round once like ``F.layer_norm``).
    """
    normalized_shape = tuple(normalized_shape)
    if weight is None and bias is None:
        return F.layer_norm(x, normalized_shape, None, None, eps)
    # Half-precision inputs are normalized in float32, so that the result is rounded once, after
    # the affine step, as F.layer_norm does with its own weight and bias. (Rounding the normalized
    # values to bfloat16 first would add an error of up to half an ulp of |y| ~ 4, i.e. ~0.016, that
    # then goes through the weight.) Float32 and float64 inputs take no extra pass.
    low_precision = x.dtype in (torch.float16, torch.bfloat16)
    y = F.layer_norm(x.float() if low_precision else x, normalized_shape, None, None, eps)
    ndim = y.dim()
    g = group_dim % ndim
    shape = [1] * ndim
    shape[g] = x.shape[g]
    shape[ndim - len(normalized_shape):] = normalized_shape
    w = None if weight is None else weight.view(shape).to(y.dtype)
    b = None if bias is None else bias.view(shape).to(y.dtype)
    if w is not None and b is not None:
        out = torch.addcmul(b, y, w)
    elif w is not None:
        out = y * w
    else:
        out = y + b
    # F.layer_norm returns the input's dtype even with affine parameters of another dtype
    return out if out.dtype == x.dtype else out.to(x.dtype)


def batched_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   group_dim: int) -> torch.Tensor:
    """N linears in one batched matmul: piece ``i`` of ``x`` times ``weight[i].T`` plus ``bias[i]``.

    ``weight`` is ``(N, out, in)``, ``bias`` ``(N, out)``. The pieces are flattened to
    ``(N, M, in)`` (a view when ``x`` is laid out group-first) and multiplied by
    ``torch.baddbmm`` (``bmm`` without bias); the result is grouped like ``x``.
    """
    xg = x.movedim(group_dim, 0)
    n, batch = xg.shape[0], xg.shape[1:-1]
    flat = xg.reshape(n, -1, xg.shape[-1])
    wt = weight.transpose(1, 2)
    y = torch.bmm(flat, wt) if bias is None else torch.baddbmm(bias.unsqueeze(1), flat, wt)
    return y.reshape((n,) + tuple(batch) + (weight.shape[1],)).movedim(0, group_dim)


def merge_group_dim(x: torch.Tensor, group_dim: int, dim: int) -> torch.Tensor:
    """``torch.cat(x.unbind(group_dim), dim)`` without the pieces: a move and a flatten.

    ``dim`` counts in the pieces' dimensions (one fewer than ``x`` has).
    """
    g = group_dim % x.dim()
    d = dim % (x.dim() - 1)
    return x.movedim(g, d).flatten(d, d + 1)

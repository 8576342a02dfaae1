"""Batched operators that the horizontal rules put into graphs.

Each works on a *grouped tensor*: N same-shape pieces stacked along ``group_dim``
(piece ``i`` is ``x.select(group_dim, i)``), so one launch does the work of N. They
are plain PyTorch, differentiable, and readable in a printed graph; they take the
number of dimensions from the tensor at run time, so a graph without shape metadata
can use them.

Three of them work on the pieces of an int split whose last piece may be shorter (its size
is not known when the graph is rewritten). They take the split's input and check at run
time, with one comparison, whether every piece is whole: then they do the grouped work on a
view; otherwise they do exactly what the unfused graph did, piece by piece.

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

__all__ = ["group_layer_norm", "batched_linear", "merge_group_dim", "piecewise_layer_norm",
           "piecewise_batched_linear", "span_of_pieces"]


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


def _split_dim(x: torch.Tensor, dim: int) -> int:
    """``dim`` as a non-negative index of ``x``; IndexError (as ``torch.split`` raises) when out of range."""
    ndim = x.dim()
    if not -ndim <= dim < ndim:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    return dim + ndim if dim < 0 else dim


def piecewise_layer_norm(x: torch.Tensor, size: int, dim: int, count: int, normalized_shape: Sequence[int],
                         weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Layer norm ``i`` (``weight[i]``, ``bias[i]``) on piece ``i`` of ``x.split(size, dim)``, ``i < count``,
    joined back along ``dim``: ``y.split(size, dim)[i]`` is the ``i``-th layer norm's result.

    When all ``count`` pieces are whole (``x.shape[dim] == count * size``) and ``dim`` lies before
    the normalized dims, this is one :func:`group_layer_norm` on the ``(..., count, size, ...)``
    view of ``x``. Otherwise (the last piece is shorter, or ``x`` has more pieces than are
    normalized) each piece is normalized on its own, as in the unfused graph; a part of ``x``
    after the ``count`` pieces is passed through unchanged.

    Example::

        x = torch.randn(4, 7 * 13 - 5, 6)             # 7 pieces of 13 along dim 1, the last of 8
        w, b = torch.randn(7, 6), torch.randn(7, 6)
        y = piecewise_layer_norm(x, 13, 1, 7, (6,), w, b, 1e-5)
        torch.testing.assert_close(y.split(13, 1)[6], F.layer_norm(x[:, 78:], (6,), w[6], b[6]))
    """
    normalized_shape = tuple(normalized_shape)
    d = _split_dim(x, dim)
    length = x.shape[d]
    if length == count * size and d <= x.dim() - len(normalized_shape):
        y = group_layer_norm(x.unflatten(d, (count, size)), normalized_shape, weight, bias, eps, d)
        return y.flatten(d, d + 1)
    pieces = x.split(size, d)
    outs = [F.layer_norm(pieces[i], normalized_shape, None if weight is None else weight[i],
                         None if bias is None else bias[i], eps) for i in range(count)]
    if length > count * size:
        outs.append(x.narrow(d, count * size, length - count * size))
    return torch.cat(outs, d)


def piecewise_batched_linear(x: torch.Tensor, size: int, dim: int, count: int, weight: torch.Tensor,
                             bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Linear ``i`` (``weight[i]``, ``bias[i]``) on piece ``i`` of ``x.split(size, dim)``, ``i < count``,
    joined along ``dim``: ``y.split(size, dim)[i]`` is the ``i``-th linear's result (when ``dim``
    is not the feature dim; along the feature dim the results are ``out_features`` long each).

    ``weight`` is ``(count, out, in)``, ``bias`` ``(count, out)`` or None. When all ``count``
    pieces are whole (``x.shape[dim] >= count * size``), this is one :func:`batched_linear`
    (one ``baddbmm``) on the ``(..., count, size, ..., in)`` view of the first ``count * size``
    rows. Otherwise (the last piece is shorter) each piece goes through its own ``F.linear``, as
    in the unfused graph. A part of ``x`` after the ``count`` pieces is not used (the unfused
    graph did not use it either), so the result holds exactly ``count`` pieces.

    Example::

        x = torch.randn(7 * 5 - 2, 13)                 # 7 pieces of 5 rows, the last of 3
        w, b = torch.randn(7, 11, 13), torch.randn(7, 11)
        y = piecewise_batched_linear(x, 5, 0, 7, w, b)
        torch.testing.assert_close(y.split(5, 0)[6], F.linear(x[30:], w[6], b[6]))
    """
    d = _split_dim(x, dim)
    length = x.shape[d]
    whole = count * size
    if length >= whole:
        grouped = (x if length == whole else x.narrow(d, 0, whole)).unflatten(d, (count, size))
        return batched_linear(grouped, weight, bias, d).flatten(d, d + 1)
    pieces = x.split(size, d)
    outs = [F.linear(pieces[i], weight[i], None if bias is None else bias[i]) for i in range(count)]
    return torch.cat(outs, d)


def span_of_pieces(x: torch.Tensor, dim: int, start: int, stop: int, size: int) -> torch.Tensor:
    """``torch.cat`` of the pieces of ``x.split(size, dim)`` that cover ``[start, stop)`` along ``dim``,
    without the pieces: a ``narrow`` view, or ``x`` itself when they cover all of it.

    The last of these pieces (from ``stop - size``) may be shorter: it ends where ``x`` ends.
    If it does not exist at all, this raises IndexError, as taking it from the split would.
    """
    d = _split_dim(x, dim)
    length = x.shape[d]
    if length <= stop - size:
        raise IndexError(f"piece {(stop - size) // size} of a split into pieces of {size} along dim {dim} does not "
                         f"exist: the tensor has {length} there")
    end = min(length, stop)
    if start == 0 and end == length:
        return x
    return x.narrow(d, start, end - start)

"""Token embedding whose backward is deterministic Triton: no zero fill, no atomics.

The forward is PyTorch's own row lookup (``F.embedding``: one gather, already at the memory floor).
The backward sums the output gradient's rows into the rows of the weight they were looked up from::

    out[p, :]      = weight[ids[p], :]                                  p = 0 .. N-1 (ids flattened)
    grad_weight[v] = sum over the positions p with ids[p] == v of grad_out[p]     (fp32, one rounding)
                     zeros where no position holds v, and for the row ``padding_idx``

How: the ids are sorted once (``torch.sort(stable=True)`` on int32 keys when the vocabulary fits,
which halves the radix passes of int64 keys); ``torch.searchsorted`` of ``0 .. V`` in the sorted ids
gives each vocabulary row its *segment* ``[bounds[v], bounds[v + 1])`` of sorted positions. The main
kernel runs a program per (vocabulary row, column tile): it walks its segment ``BLOCK_R`` positions at
a time, gathers those rows of the output gradient through the sort's permutation, adds them in fp32
and writes its tile of ``grad_weight`` once, zeros included, in the weight's dtype.

A frequent id (the pad token in half a batch, "the" in text) would leave one program to read
thousands of rows alone while the others are long done. So a segment longer than ``CHUNK`` (32)
sorted positions is summed in two passes: a first kernel cuts the sorted positions into chunks of
``CHUNK`` and sums, per chunk and column tile, the part of each long segment inside it (at most two:
a segment longer than a chunk cannot lie strictly inside one); the long segment's program in the main
kernel then adds its chunks' partial sums in chunk order. Where no id is that frequent the first
kernel's programs only read a few integers.

Nothing waits on the host (no ``.item()``, no shape that depends on the ids), so the backward can be
captured in a CUDA graph.

Bytes moved (N positions, V rows, D columns, fp32 weight and gradient): the output gradient is read
once (``4 N D``), ``grad_weight`` written once (``4 V D``), plus the sort and the bounds (a few bytes
per position and per row) and, for long segments, their partial sums (at most ``2 * 4 D`` per chunk,
written once and read once). For a LLaMA-1.1B step (N = 8192 tokens, V = 32000, D = 2048) that is
67 MB read and 262 MB written: about 70 us at the H200's 4.8 TB/s. PyTorch's eager backward
(``embedding_dense_backward``) zero-fills the 262 MB gradient, sorts int64 ids (8 radix passes),
then sums and scatters in two more passes, about 15 launches: it took about 390 us at these shapes
on an H200.

Determinism: every element of ``grad_weight`` is written by exactly one program, which adds its
rows in one fixed order: the stable sort keeps the positions of an id ascending, ``BLOCK_R`` of
them (or ``BLOCK_C`` partial sums) are added at a time by a fixed reduction tree, and a chunk's
partial sum is likewise made by one program. The launch shape depends only on D and is not
autotuned, since another shape would add in another order. Two runs give the same bits.

Launch shape: the main kernel's grid is ``(V, cdiv(D, BLOCK_D))``, the first kernel's
``(cdiv(N, CHUNK), cdiv(D, BLOCK_D))``, with ``BLOCK_D`` = the next power of two >= D, at most 2048:
a row of LLaMA's 2048 columns is one program of 4 warps (16 fp32 accumulators a thread), and a row
absent from the batch costs its program two loads and one 8 KB store, so programs are few enough
for their launch not to matter next to the stores.

Example::

    out = embedding(input_ids, model.embed_tokens.weight, padding_idx=0)
    out.sum().backward()            # grad of the weight from the Triton kernels
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from schedlang.argument_checks import FLOATING_DTYPES, check_tensor, shown
from schedlang.errors import ArgumentTypeError, ScheduleValueError
from schedlang.kernels.embedding_reference import embedding_reference
from schedlang.kernels.row_kernels import as_rows, cast_rounded, next_power_of_2, triton_dtype, use_triton_for

__all__ = ["embedding", "embedding_backward", "reference", "normalized_padding_idx", "INDEX_DTYPES"]

reference = embedding_reference

#: dtypes of token ids that ``F.embedding`` takes
INDEX_DTYPES = (torch.int64, torch.int32)

#: widest column tile of a program: 8 KB of fp32 accumulators, 16 per thread of 4 warps
_MAX_BLOCK_D = 2048
#: sorted positions per chunk of the first pass; a segment longer than this is "long"
_CHUNK = 32
#: partial sums of chunks added per step of a long segment's program
_BLOCK_C = 8


@triton.jit
def _sum_rows(dy_ptr, perm_ptr, lo, hi, cols, col_ok, stride_dy, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """fp32 sum of the output gradient's rows ``perm[lo:hi]`` over the columns ``cols``, ``BLOCK_R`` at a time."""
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for first in range(lo, hi, BLOCK_R):
        pos = first + tl.arange(0, BLOCK_R)
        row_ok = pos < hi
        rows = tl.load(perm_ptr + pos, mask=row_ok, other=0).to(tl.int64)
        tile = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :],
                       mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(tile.to(tl.float32), axis=0)
    return acc


@triton.jit
def _long_segment_partials_kernel(dy_ptr, sorted_ptr, perm_ptr, bounds_ptr, partial_ptr, N, D, stride_dy,
                                  padding_idx, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (c, t) sums, over the columns of tile t, the part of each long segment inside the chunk c of
    # sorted positions. A segment longer than the chunk cannot lie strictly inside it, so at most two long
    # segments meet a chunk: the one holding its first position (slot 0) and, if another, the one holding
    # its last position (slot 1). The padding row's segment is skipped (its partials would not be read),
    # and so is slot 1 when the segment of the last position is that of the first (slot 0 has it whole).
    c = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    first = c.to(tl.int64) * CHUNK
    last = tl.minimum(first + CHUNK, N) - 1
    out = partial_ptr + c.to(tl.int64) * 2 * D + cols
    v0 = tl.load(sorted_ptr + first)
    end0 = tl.load(bounds_ptr + v0 + 1)
    long0 = (end0 - tl.load(bounds_ptr + v0) > CHUNK) & (v0 != padding_idx)
    acc = _sum_rows(dy_ptr, perm_ptr, first, tl.where(long0, tl.minimum(end0, last + 1), first), cols, col_ok,
                    stride_dy, BLOCK_R, BLOCK_D)
    # (a scalar condition folded into the column bound: the interpreter cannot broadcast a boolean scalar)
    tl.store(out, acc, mask=cols < tl.where(long0, D, 0))
    v1 = tl.load(sorted_ptr + last)
    start1 = tl.load(bounds_ptr + v1)
    long1 = (tl.load(bounds_ptr + v1 + 1) - start1 > CHUNK) & (v1 != v0) & (v1 != padding_idx)
    acc = _sum_rows(dy_ptr, perm_ptr, start1, tl.where(long1, last + 1, start1), cols, col_ok,
                    stride_dy, BLOCK_R, BLOCK_D)
    tl.store(out + D, acc, mask=cols < tl.where(long1, D, 0))


@triton.jit
def _embedding_backward_kernel(dy_ptr, perm_ptr, bounds_ptr, partial_ptr, dw_ptr, D, stride_dy, padding_idx,
                               OUT_DTYPE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
                               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    v = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    start = tl.load(bounds_ptr + v)
    end = tl.load(bounds_ptr + v + 1)
    # the padding row gets no gradient: its segment is read as empty, and its tile written as zeros
    end = tl.where(v == padding_idx, start, end)
    is_long = end - start > CHUNK
    # a short segment: its rows, gathered through the sort's permutation
    acc = _sum_rows(dy_ptr, perm_ptr, start, tl.where(is_long, start, end), cols, col_ok, stride_dy,
                    BLOCK_R, BLOCK_D)
    # a long one: the first pass's partial sums of the chunks it spans, in chunk order. It holds the last
    # position of its first chunk (slot 1 there, unless it starts that chunk: slot 0) and the first
    # position of each later chunk (slot 0).
    c_first = start // CHUNK
    c_last = (end - 1) // CHUNK
    first_slot = tl.where(start % CHUNK == 0, 0, 1)
    for c in range(c_first, tl.where(is_long, c_last + 1, c_first), BLOCK_C):
        chunks = c + tl.arange(0, BLOCK_C)
        slots = tl.where(chunks == c_first, first_slot, 0)
        tile = tl.load(partial_ptr + (chunks * 2 + slots)[:, None] * D + cols[None, :],
                       mask=(chunks <= c_last)[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(tile, axis=0)
    tl.store(dw_ptr + v.to(tl.int64) * D + cols, cast_rounded(acc, OUT_DTYPE), mask=col_ok)


def _launch_shape(d: int):
    """``(BLOCK_R, BLOCK_D)`` for rows of ``d`` columns: a tile of at most 2048 columns, and about 8192
    gradient elements gathered per step of a segment (4 rows of LLaMA's 2048 columns: most ids of a
    batch occur once or twice, and a segment of more than 32 goes through the chunks' partial sums)."""
    block_d = min(_MAX_BLOCK_D, next_power_of_2(d))
    return max(1, min(64, 8192 // block_d)), block_d


def embedding_backward(grad_out: torch.Tensor, ids: torch.Tensor, num_embeddings: int,
                       padding_idx: Optional[int], dtype: torch.dtype) -> torch.Tensor:
    """The gradient of ``weight`` (``(num_embeddings, D)`` of ``dtype``) for ``out = weight[ids]`` given
    ``grad_out`` (``ids.shape + (D,)``, fp32, bf16 or fp16); ``padding_idx`` normalized (>= 0) or None."""
    d = grad_out.shape[-1]
    grad_weight = torch.empty((num_embeddings, d), dtype=dtype, device=grad_out.device)
    if grad_weight.numel() == 0:
        return grad_weight
    if ids.numel() == 0:
        return grad_weight.zero_()
    ids_flat = ids.reshape(-1)
    n = ids_flat.numel()
    # int32 keys halve the radix passes; every boundary 0 .. V must fit the key dtype too
    keys = ids_flat.to(torch.int32) if num_embeddings < 2 ** 31 - 1 else ids_flat.to(torch.int64)
    sorted_ids, perm = torch.sort(keys, stable=True)
    bounds = torch.searchsorted(sorted_ids, torch.arange(num_embeddings + 1, dtype=keys.dtype, device=keys.device))
    # rows whose columns are contiguous (a copy only when no strided view has them, e.g. the expanded
    # gradient of a sum): a tile of a row is then one vectorized load, at any row stride
    dy = as_rows(grad_out)
    block_r, block_d = _launch_shape(d)
    tiles = triton.cdiv(d, block_d)
    chunks = triton.cdiv(n, _CHUNK)
    pad = -1 if padding_idx is None else padding_idx
    # per chunk of sorted positions, the fp32 partial sums of at most two long segments (written only for those)
    partials = torch.empty((chunks, 2, d), dtype=torch.float32, device=dy.device)
    _long_segment_partials_kernel[(chunks, tiles)](
        dy, sorted_ids, perm, bounds, partials, n, d, dy.stride(0), pad,
        CHUNK=_CHUNK, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    _embedding_backward_kernel[(num_embeddings, tiles)](
        dy, perm, bounds, partials, grad_weight, d, dy.stride(0), pad,
        OUT_DTYPE=triton_dtype(dtype), CHUNK=_CHUNK, BLOCK_C=_BLOCK_C, BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=4)
    return grad_weight


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.num_embeddings, ctx.padding_idx, ctx.weight_dtype = weight.shape[0], padding_idx, weight.dtype
        return F.embedding(ids, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[1]:
            return None, None, None
        ids, = ctx.saved_tensors
        return None, embedding_backward(grad_out, ids, ctx.num_embeddings, ctx.padding_idx, ctx.weight_dtype), None


def normalized_padding_idx(where: str, padding_idx, num_embeddings: int) -> Optional[int]:
    """``padding_idx`` as ``nn.Embedding`` keeps it: None, or a row in ``[0, num_embeddings)`` (a negative
    one counts from the end); anything else raises, naming ``where``."""
    if padding_idx is None:
        return None
    if not isinstance(padding_idx, numbers.Integral) or isinstance(padding_idx, bool):
        raise ArgumentTypeError(f"{where}: padding_idx must be an int or None, got {shown(padding_idx)}")
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ScheduleValueError(f"{where}: padding_idx={padding_idx} is out of range for {num_embeddings} "
                                 f"embeddings: valid are {-num_embeddings}..{num_embeddings - 1} or None")
    return int(padding_idx) + num_embeddings if padding_idx < 0 else int(padding_idx)


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: Optional[int] = None) -> torch.Tensor:
    """``F.embedding(ids, weight, padding_idx=padding_idx)``, with the weight's gradient from
    deterministic Triton kernels (a fixed order of addition: the same bits every run).

    ``ids`` int64 or int32 of any shape, ``weight`` ``(num_embeddings, embedding_dim)``; the result has
    shape ``ids.shape + (embedding_dim,)``. The row ``padding_idx`` (negative counts from the end) gets
    no gradient. Runs the kernels on CUDA (and on the CPU under ``TRITON_INTERPRET=1``), else
    :func:`reference`; under ``torch.compile`` the reference is traced. Ids out of range fail in the
    forward, as in ``F.embedding``.

    Example::

        out = embedding(torch.tensor([[1, 2, 2, 0]]), torch.randn(37, 100), padding_idx=0)
    """
    check_tensor("embedding", "ids", ids, INDEX_DTYPES)
    check_tensor("embedding", "weight", weight, FLOATING_DTYPES)
    if weight.dim() != 2:
        raise ScheduleValueError(f"embedding: weight of shape {tuple(weight.shape)} must be 2-D: expected "
                                 f"(num_embeddings, embedding_dim)")
    padding_idx = normalized_padding_idx("embedding", padding_idx, weight.shape[0])
    if use_triton_for(weight) and type(ids) is torch.Tensor and ids.device == weight.device:
        return _Embedding.apply(ids, weight, padding_idx)
    return reference(ids, weight, padding_idx)

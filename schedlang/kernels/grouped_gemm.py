"""Grouped matrix product for the local experts of a mixture-of-experts block: Triton forward and backward.

The rows of ``x`` [M, K] come grouped by expert (``counts[e]`` rows for expert e, in order; a count may
be 0), and each group is multiplied by its expert's matrix::

    out[rows of e]  = x[rows of e] @ W_e                   W_e = w[e] [K, N], or w[e].T when transposed
    grad x[rows of e] = grad_out[rows of e] @ W_e.T
    grad W_e          = x[rows of e].T @ grad_out[rows of e]    (zeros for an expert of no rows)

``transposed=True`` takes ``w`` as [E, N, K], nn.Linear's layout, which is how transformers keeps
``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I].

How: the rows of each expert are cut into tiles of ``BLOCK_M`` rows (an expert's last tile partial, an
expert of no rows none). A *tile schedule* lists, for every row tile, its expert and first row; it is
computed on the device from the counts (cumulative sums and a ``searchsorted``), so nothing waits on
the host. The number of row tiles depends on the counts, so the grid is launched for its upper bound,
``cdiv(M, BLOCK_M) + E`` (each expert adds at most one partial tile), and a program past the schedule's
end runs no loop and stores nothing. Two kernels:

* rows kernel, for the output and the input's gradient: one program per (row tile, column tile) reads
  its tile's expert from the schedule and accumulates ``x_tile @ W_e`` over K in fp32 (``tl.dot``),
  rounding once at the store. The input's gradient is the same kernel with ``W_e`` read transposed
  (strides swapped): no copy of the weights.
* weight kernel, for the weights' gradient: one program per (expert, K tile, N tile) walks its expert's
  rows ``BLOCK_M`` at a time, accumulating ``x_e.T @ grad_e`` in fp32; an expert of no rows writes zeros.

fp32 inputs are multiplied in full fp32 (``input_precision="ieee"``) unless PyTorch's own matmuls may use
TF32 (``torch.backends.cuda.matmul.allow_tf32``), so that the kernel agrees with an fp32 per-expert loop.

On CUDA, ``backend="auto"`` hands bf16 products to ``torch._grouped_mm`` (cuBLAS/CUTLASS grouped GEMM, with
its own backward) where this PyTorch has it and the device is a Hopper (sm90) or newer and K and N are
multiples of 8 (16-byte rows); everything else runs the Triton kernels. ``backend="triton"`` and
``backend="torch"`` force one; :func:`reference` (``backend="reference"``) loops over the experts in
PyTorch, and is what runs for CPU tensors unless ``TRITON_INTERPRET=1``.

Bytes and flops: the product is ``2 M K N`` flops forward and twice that backward, as for the dense
matmuls it replaces; the schedule is ``O(E + M / BLOCK_M)`` integers.

Example::

    counts = torch.bincount(expert_of_row, minlength=E)          # rows sorted by expert
    h = grouped_mm(rows, experts.gate_up_proj, counts, transposed=True)   # [M, 2I]
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from schedlang.argument_checks import check_tensor
from schedlang.errors import ArgumentTypeError, ScheduleValueError
from schedlang.kernels.grouped_gemm_reference import grouped_mm_reference
from schedlang.kernels.row_kernels import cast_rounded, interpreting, triton_dtype, tuned, use_triton_for

__all__ = ["grouped_mm", "reference", "tile_schedule", "torch_grouped_mm_supports", "BACKENDS"]

reference = grouped_mm_reference

#: what ``backend`` may name
BACKENDS = ("auto", "triton", "torch", "reference")

#: dtypes the Triton kernels take (others run the reference)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: rows per tile on the GPU (the schedule is made for it, so it is fixed rather than autotuned)
_BLOCK_M = 128
#: rows per tile under the interpreter: tl.dot needs at least 16, and few programs run fastest there
_INTERPRETER_BLOCK_M = 16
_INTERPRETER_META = {"BLOCK_N": 32, "BLOCK_K": 32}


@triton.jit
def _grouped_rows_kernel(a_ptr, b_ptr, c_ptr, tile_expert_ptr, tile_row_ptr, row_end_ptr, N, K,
                         stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                         OUT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (row tile t, column tile j), j fastest: the programs of one row tile run together and share
    # its rows of ``a`` in L2, and consecutive row tiles of one expert share its matrix
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(N, BLOCK_N)
    tile = pid // col_tiles
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(tile_expert_ptr + tile)
    valid = expert >= 0
    expert = tl.maximum(expert, 0)
    first = tl.load(tile_row_ptr + tile)
    # a program past the schedule's end reads an empty row range: no K loop, nothing stored
    end = tl.where(valid, tl.load(row_end_ptr + expert), first)
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    col_ok = cols < N
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + expert.to(tl.int64) * stride_be + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.where(valid, K, 0), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_rows + ks[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + ks[:, None] * stride_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(out, cast_rounded(acc, OUT_DTYPE), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_weight_grad_kernel(x_ptr, dy_ptr, dw_ptr, row_start_ptr, row_end_ptr, K, N,
                                stride_xm, stride_xk, stride_dym, stride_dyn, stride_we, stride_wk, stride_wn,
                                OUT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = ks < K
    col_ok = cols < N
    start = tl.load(row_start_ptr + expert)
    end = tl.load(row_end_ptr + expert)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        rows64 = rows.to(tl.int64)
        xt = tl.load(x_ptr + rows64[None, :] * stride_xm + ks[:, None] * stride_xk,
                     mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        g = tl.load(dy_ptr + rows64[:, None] * stride_dym + cols[None, :] * stride_dyn,
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            xt, g = xt.to(tl.float32), g.to(tl.float32)
        acc = tl.dot(xt, g, acc, input_precision=PRECISION)
    out = dw_ptr + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    tl.store(out, cast_rounded(acc, OUT_DTYPE), mask=k_ok[:, None] & col_ok[None, :])


def _configs(block_m_name: str):
    # the rows kernel's BLOCK_M is fixed by the schedule; the weight kernel tunes its own
    sizes = [(128, 64, 4, 4), (128, 64, 8, 3), (64, 64, 4, 4), (256, 64, 8, 3), (128, 32, 4, 5)]
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in sizes]
    if block_m_name:
        configs = [triton.Config({**c.kwargs, block_m_name: m}, num_warps=c.num_warps, num_stages=c.num_stages)
                   for c in configs for m in (64, 128)]
    return configs


_ROWS = tuned(_grouped_rows_kernel, _configs(""), key=["N", "K"])
_WEIGHT_GRAD = tuned(_grouped_weight_grad_kernel, _configs("BLOCK_M"), key=["N", "K"])


def _upcast(dtype: torch.dtype) -> bool:
    # the interpreter's tl.dot multiplies numpy arrays, which have no bf16: half-precision tiles are widened
    # to fp32 first (exact, and what the GPU's tensor cores do with each product before adding in fp32)
    return interpreting() and dtype != torch.float32


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not interpreting() and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def tile_schedule(counts: torch.Tensor, rows: int, block_m: int) -> Tuple[torch.Tensor, ...]:
    """The row tiles of experts with ``counts`` rows each (``rows`` in all), ``block_m`` rows a tile, made
    on the counts' device without a host sync: ``(tile_expert, tile_row, row_start, row_end)``, the first
    two of length ``cdiv(rows, block_m) + E`` (the most tiles any counts summing to ``rows`` need), the
    expert of each tile (-1 past the last tile) and its first row; the last two [E], each expert's rows."""
    experts = counts.shape[0]
    counts = counts.to(torch.int64)
    row_end = torch.cumsum(counts, 0)
    row_start = row_end - counts
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    slots = torch.arange(triton.cdiv(rows, block_m) + experts, device=counts.device)
    # the expert whose tiles cover slot t: the first whose cumulative tile count exceeds t (an expert of
    # no tiles is never the first, so it is skipped)
    expert = torch.searchsorted(tile_end, slots, right=True)
    inside = expert < experts
    clamped = expert.clamp(max=max(experts - 1, 0))
    tile_row = row_start[clamped] + (slots - (tile_end - tiles)[clamped]) * block_m
    tile_expert = torch.where(inside, clamped, torch.full_like(clamped, -1))
    return tile_expert.to(torch.int32), tile_row.to(torch.int64), row_start, row_end


def _rows_product(a: torch.Tensor, b: torch.Tensor, b_strides: Tuple[int, int, int], n: int,
                  schedule, block_m: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``[M, n]``: each row tile of ``a`` [M, K] times its expert's matrix of ``b``, read with ``b_strides``
    (expert, k, n)."""
    tile_expert, tile_row, _, row_end = schedule
    m, k = a.shape
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    _ROWS.launch(lambda meta: (tile_expert.shape[0] * triton.cdiv(n, meta["BLOCK_N"]),),
                 a, b, out, tile_expert, tile_row, row_end, n, k,
                 a.stride(0), a.stride(1), *b_strides, out.stride(0), out.stride(1),
                 OUT_DTYPE=triton_dtype(out_dtype), PRECISION=_precision(a.dtype), UPCAST=_upcast(a.dtype),
                 BLOCK_M=block_m,
                 interpreter_meta=_INTERPRETER_META)
    return out


def _weight_grad(x: torch.Tensor, dy: torch.Tensor, schedule, w_shape, w_dtype: torch.dtype,
                 transposed: bool) -> torch.Tensor:
    """The gradient of ``w`` (``w_shape``): per expert ``x_e.T @ dy_e`` [K, N], stored [E, N, K] when
    ``transposed``; zeros for an expert of no rows."""
    _, _, row_start, row_end = schedule
    experts = w_shape[0]
    k, n = x.shape[1], dy.shape[1]
    dw = torch.empty(w_shape, dtype=w_dtype, device=x.device)
    if dw.numel() == 0:
        return dw
    if x.shape[0] == 0:
        return dw.zero_()
    # strides of dw read as [E, K, N]
    strides = (dw.stride(0), dw.stride(2), dw.stride(1)) if transposed else dw.stride()
    interpreter_meta = dict(_INTERPRETER_META, BLOCK_M=_INTERPRETER_BLOCK_M)
    _WEIGHT_GRAD.launch(lambda meta: (experts, triton.cdiv(k, meta["BLOCK_K"]), triton.cdiv(n, meta["BLOCK_N"])),
                        x, dy, dw, row_start, row_end, k, n, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
                        *strides, OUT_DTYPE=triton_dtype(w_dtype), PRECISION=_precision(x.dtype),
                        UPCAST=_upcast(x.dtype), interpreter_meta=interpreter_meta)
    return dw


def _weight_strides(w: torch.Tensor, transposed: bool) -> Tuple[int, int, int]:
    """``w``'s strides read as [E, K, N] (the product's own orientation)."""
    return (w.stride(0), w.stride(2), w.stride(1)) if transposed else tuple(w.stride())


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts, transposed):
        block_m = _INTERPRETER_BLOCK_M if interpreting() else _BLOCK_M
        schedule = tile_schedule(counts, x.shape[0], block_m)
        n = w.shape[1] if transposed else w.shape[2]
        out = _rows_product(x, w, _weight_strides(w, transposed), n, schedule, block_m, x.dtype)
        ctx.save_for_backward(x, w, *schedule)
        ctx.transposed, ctx.block_m = transposed, block_m
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, w, *schedule = ctx.saved_tensors
        grad_x = grad_w = None
        grad_out = grad_out.to(x.dtype)
        if ctx.needs_input_grad[0]:
            e_stride, k_stride, n_stride = _weight_strides(w, ctx.transposed)
            # grad x = grad_out @ W_e.T: the same kernel, W_e read as [N, K]
            grad_x = _rows_product(grad_out, w, (e_stride, n_stride, k_stride), x.shape[1], schedule, ctx.block_m,
                                   x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(x, grad_out, schedule, tuple(w.shape), w.dtype, ctx.transposed)
        return grad_x, grad_w, None, None


def torch_grouped_mm_supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes this product: this PyTorch has it, both tensors bf16 plain tensors on
    one CUDA device of compute capability 9.0 or more, K and N multiples of 8 (rows of 16 bytes)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    if not use_triton_for(x, w) or x.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    return x.shape[1] % 8 == 0 and w.shape[1] % 8 == 0 and w.shape[2] % 8 == 0


def _torch_grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, transposed: bool) -> torch.Tensor:
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    return torch._grouped_mm(x, w.transpose(-2, -1) if transposed else w, offs=offsets)


def _check(x, w, counts, transposed, backend) -> None:
    check_tensor("grouped_mm", "x", x, _KERNEL_DTYPES + (torch.float64,))
    check_tensor("grouped_mm", "w", w, _KERNEL_DTYPES + (torch.float64,))
    check_tensor("grouped_mm", "counts", counts)
    if not isinstance(transposed, bool):
        raise ArgumentTypeError(f"grouped_mm: transposed must be a bool, got {type(transposed).__name__}")
    if backend not in BACKENDS:
        raise ScheduleValueError(f"grouped_mm: backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    if x.dim() != 2 or w.dim() != 3:
        raise ScheduleValueError(f"grouped_mm: x {tuple(x.shape)} must be 2-D [M, K] and w {tuple(w.shape)} 3-D "
                                 f"[E, {'N, K' if transposed else 'K, N'}]")
    k = w.shape[2] if transposed else w.shape[1]
    if x.shape[1] != k:
        raise ScheduleValueError(f"grouped_mm: x has {x.shape[1]} columns but w {tuple(w.shape)} "
                                 f"(transposed={transposed}) multiplies {k}: expected x [M, {k}]")
    if x.dtype != w.dtype:
        raise ScheduleValueError(f"grouped_mm: x is {x.dtype} but w is {w.dtype}: expected one dtype")
    if counts.dim() != 1 or counts.shape[0] != w.shape[0] or counts.is_floating_point() or counts.dtype == torch.bool:
        raise ScheduleValueError(f"grouped_mm: counts of shape {tuple(counts.shape)} and dtype {counts.dtype} must "
                                 f"be integers [E] = [{w.shape[0]}], one count of rows per expert of w")
    if counts.device != x.device:
        raise ScheduleValueError(f"grouped_mm: counts are on {counts.device} but x on {x.device}: expected one device")
    if counts.device.type == "cpu" and not torch.compiler.is_compiling():
        # on a GPU this would wait for the device; there, counts that do not add up leave rows unwritten
        total = int(counts.sum())
        if total != x.shape[0] or bool((counts < 0).any()):
            raise ScheduleValueError(f"grouped_mm: counts {counts.tolist()} must be >= 0 and add up to the "
                                     f"{x.shape[0]} rows of x, got {total}")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, transposed: bool = False,
               backend: str = "auto") -> torch.Tensor:
    """``[M, N]``: the rows of ``x`` [M, K], grouped by expert (``counts[e]`` rows of expert e, in order, some
    counts 0), each group times its expert's matrix of ``w`` [E, K, N] (``transposed``: [E, N, K], and the
    group times ``w[e].T``, as ``F.linear``). Differentiable in ``x`` and ``w``; fp32 accumulation, one
    rounding to the inputs' dtype (fp32, bf16 or fp16; float64 runs the reference).

    ``backend``: ``"auto"`` (``torch._grouped_mm`` where :func:`torch_grouped_mm_supports`, else the Triton
    kernels on CUDA and under ``TRITON_INTERPRET=1``, else :func:`reference`), ``"triton"``, ``"torch"`` or
    ``"reference"``. A forced backend that cannot run these tensors raises. On CPU the counts are checked to add
    up to M; on a GPU they are not (that would wait for the device), and rows past their sum are left unset.

    Example::

        out = grouped_mm(torch.randn(8, 5), torch.randn(3, 5, 7), torch.tensor([3, 0, 5]))   # [8, 7]
    """
    _check(x, w, counts, transposed, backend)
    if backend == "auto":
        if torch_grouped_mm_supports(x, w):
            backend = "torch"
        elif use_triton_for(x, w) and x.dtype in _KERNEL_DTYPES:
            backend = "triton"
        else:
            backend = "reference"
    if backend == "torch":
        if not torch_grouped_mm_supports(x, w):
            raise ScheduleValueError(f"grouped_mm: backend='torch' needs torch._grouped_mm, bf16 tensors on a CUDA "
                                     f"device of compute capability >= 9.0 and K, N multiples of 8; got {x.dtype} on "
                                     f"{x.device}, x {tuple(x.shape)}, w {tuple(w.shape)}: use backend='auto'")
        return _torch_grouped_mm(x, w, counts, transposed)
    if backend == "triton":
        if not (use_triton_for(x, w) and x.dtype in _KERNEL_DTYPES):
            raise ScheduleValueError(f"grouped_mm: backend='triton' needs fp32, bf16 or fp16 tensors on one CUDA "
                                     f"device (or on the CPU under TRITON_INTERPRET=1); got {x.dtype} on {x.device}: "
                                     f"use backend='auto'")
        return _GroupedMM.apply(x, w, counts, transposed)
    return reference(x, w, counts, transposed)

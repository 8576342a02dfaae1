"""RMSNorm, optionally fused with the residual add before it: Triton forward and backward.

Maths per row of ``N`` values (HF ``LlamaRMSNorm``'s order of casts; fp32 inside)::

    s    = x + r                               # rounded to the input dtype, as HF's residual add
    rstd = 1 / sqrt(mean(s^2) + eps)
    n    = s * rstd                            # rounded to the input dtype (HF: .to(input_dtype))
    y    = w * n                               # rounded to promote(w dtype, input dtype)

    backward, with dy the gradient of y and ds_out the gradient of the new residual s:
    dn   = dy * w
    ds   = rstd * (dn - n * mean(dn * n)) + ds_out           (= dx = dr)
    dw   = sum over rows of dy * n

Bytes moved per element (2-byte dtypes): forward reads x (and r), writes y (and s): 4 (8) bytes;
backward reads dy, s (and ds_out), writes dx: 6 (8) bytes; ``rstd`` is 4 bytes per row. Eager
PyTorch moves several times this (the fp32 copy, the square, the mean, the product...), each a
separate kernel.

Launch shape: a program owns ``BLOCK_M`` whole rows (``BLOCK_N`` = next power of two >= N, so a row
is one vectorized load, one reduction, one store). The forward is autotuned on N. The backward is a
persistent grid of at most a few programs per SM; each walks its share of the rows and keeps its
partial ``dw`` in fp32 registers, written once to a ``(programs, N)`` buffer summed at the end: no
atomics, deterministic.

Example::

    y = rms_norm(x, weight, 1e-6)
    y, residual = rms_norm(attn_out, weight, 1e-6, residual=residual)   # fused add + norm
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from schedlang.argument_checks import FLOATING_DTYPES, check_number, check_tensor
from schedlang.errors import ScheduleValueError
from schedlang.kernels.rms_norm_reference import rms_norm_reference
from schedlang.kernels.row_kernels import (as_rows, cast_rounded, next_power_of_2, sm_count, triton_dtype, tuned,
                                           use_triton_for)

__all__ = ["rms_norm", "reference", "MAX_HIDDEN", "COMPILED_FORMS", "check_compiled_form"]

logger = logging.getLogger("schedlang.kernels.rms_norm")
reference = rms_norm_reference

#: widest row kept in registers; wider rows go to the reference
MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_forward_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, rstd_ptr, M, N,
                             stride_x, stride_r, stride_y, stride_s, eps,
                             HAS_RESIDUAL: tl.constexpr, IN_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    s = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s_low = cast_rounded(s + r, IN_DTYPE)
        tl.store(s_ptr + rows64 * stride_s + cols[None, :], s_low, mask=mask)
        s = s_low.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / N + eps)
    n = cast_rounded(s * rstd[:, None], IN_DTYPE).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = cast_rounded(n * w[None, :], OUT_DTYPE)
    tl.store(y_ptr + rows64 * stride_y + cols[None, :], y, mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_backward_kernel(dy_ptr, s_ptr, w_ptr, rstd_ptr, ds_out_ptr, dx_ptr, dw_partial_ptr, M, N,
                              stride_dy, stride_s, stride_dso, stride_dx,
                              HAS_RESIDUAL_GRAD: tl.constexpr, IN_DTYPE: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(pid * BLOCK_M, M, programs * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        dy = tl.load(dy_ptr + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + rows64 * stride_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        n = s * rstd[:, None]
        dw += tl.sum(dy * cast_rounded(n, IN_DTYPE).to(tl.float32), axis=0)
        dn = dy * w[None, :]
        ds = rstd[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / N)[:, None])
        if HAS_RESIDUAL_GRAD:
            ds += tl.load(ds_out_ptr + rows64 * stride_dso + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows64 * stride_dx + cols[None, :], cast_rounded(ds, IN_DTYPE), mask=mask)
    tl.store(dw_partial_ptr + pid.to(tl.int64) * N + cols, dw, mask=col_ok)


def _keep_small_blocks(configs, named_args, **kwargs):
    """Drop configurations whose block (rows x padded row) would not fit in registers."""
    width = next_power_of_2(named_args["N"])
    kept = [c for c in configs if c.kwargs["BLOCK_M"] * width <= 16384]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"])]


_FORWARD = tuned(
    _rms_norm_forward_kernel,
    [triton.Config({"BLOCK_M": m}, num_warps=w) for m, w in
     ((1, 4), (1, 8), (2, 4), (2, 8), (4, 4), (4, 8), (8, 4), (16, 4), (32, 4))],
    key=["N"], prune=_keep_small_blocks)

# rows per program in the interpreter: few, wide programs run fastest there
_INTERPRETER_ROWS = 64


def _backward_rows(n: int) -> int:
    """Rows per iteration of a backward program: about 4096 elements of each operand."""
    return max(1, min(16, 4096 // next_power_of_2(n)))


def _forward(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor], eps: float
             ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """The forward kernel: ``(y, s, rstd)`` as 2-D rows; ``s`` (``x + residual``) is None without a residual."""
    n = x.shape[-1]
    x2 = as_rows(x)
    r2 = as_rows(residual) if residual is not None else None
    m = x2.shape[0]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    s = torch.empty((m, n), dtype=x.dtype, device=x.device) if residual is not None else None
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    block_n = next_power_of_2(n)
    if m > 0:
        _FORWARD.launch(
            lambda meta: (triton.cdiv(m, meta["BLOCK_M"]),),
            x2, r2 if r2 is not None else x2, weight.contiguous(), y, s if s is not None else y, rstd, m, n,
            x2.stride(0), r2.stride(0) if r2 is not None else 0, y.stride(0), s.stride(0) if s is not None else 0,
            eps, HAS_RESIDUAL=residual is not None, IN_DTYPE=triton_dtype(x.dtype),
            OUT_DTYPE=triton_dtype(out_dtype), BLOCK_N=block_n,
            interpreter_meta={"BLOCK_M": max(1, min(_INTERPRETER_ROWS, 8192 // block_n))})
    return y, s, rstd


def _backward(dy: Optional[torch.Tensor], ds_out: Optional[torch.Tensor], s: torch.Tensor, weight: torch.Tensor,
              rstd: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The backward kernel over 2-D rows ``s`` (the normalized input): ``(dx, dw)``; ``ds_out`` (the
    gradient of the new residual, or None) is added to ``dx``."""
    m, n = s.shape
    w = weight.contiguous()
    dy2 = as_rows(dy) if dy is not None else torch.zeros((m, n), dtype=w.dtype, device=s.device)
    ds2 = as_rows(ds_out) if ds_out is not None else None
    dx = torch.empty((m, n), dtype=s.dtype, device=s.device)
    if m == 0:
        return dx, torch.zeros((n,), dtype=weight.dtype, device=s.device)
    block_n = next_power_of_2(n)
    block_m = _backward_rows(n)
    programs = max(1, min(triton.cdiv(m, block_m), 4 * sm_count(s.device)))
    dw_partial = torch.empty((programs, n), dtype=torch.float32, device=s.device)
    _rms_norm_backward_kernel[(programs,)](
        dy2, s, w, rstd, ds2 if ds2 is not None else dy2, dx, dw_partial, m, n,
        dy2.stride(0), s.stride(0), ds2.stride(0) if ds2 is not None else 0, dx.stride(0),
        HAS_RESIDUAL_GRAD=ds2 is not None, IN_DTYPE=triton_dtype(s.dtype),
        BLOCK_N=block_n, BLOCK_M=block_m, num_warps=4 if block_n <= 2048 else 8)
    return dx, dw_partial.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    """Eager calls: an autograd Function (less dispatch per call than the custom operator below)."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        y, s, rstd = _forward(x, weight, residual, eps)
        ctx.save_for_backward(s if s is not None else as_rows(x), weight, rstd)
        ctx.has_residual = residual is not None
        ctx.shape = x.shape
        y = y.view(x.shape)
        if residual is None:
            return y
        return y, s.view(x.shape)

    @staticmethod
    def backward(ctx, dy, ds_out=None):
        s, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, ds_out if ctx.has_residual else None, s, weight, rstd)
        dx = dx.view(ctx.shape)
        return dx, dw, (dx if ctx.has_residual else None), None


# Under torch.compile the kernels run as custom operators: opaque to Inductor, which calls them from
# its generated code as it calls a GEMM, and keeps their saved tensors (the normalized input and one
# fp32 rstd per row) instead of recomputing the norm in its own backward kernels.
@torch.library.custom_op("schedlang::rms_norm_forward", mutates_args=())
def _rms_norm_forward_op(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor], eps: float
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, s, rstd = _forward(x, weight, residual, eps)
    # a custom operator may not return its input: without a residual, ``s`` is an empty stand-in
    return y.view(x.shape), (s.view(x.shape) if s is not None else x.new_empty((0,))), rstd


@_rms_norm_forward_op.register_fake
def _(x, weight, residual, eps):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    y = x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
    s = x.new_empty(x.shape) if residual is not None else x.new_empty((0,))
    return y, s, x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op("schedlang::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: torch.Tensor, ds_out: Optional[torch.Tensor], s: torch.Tensor, weight: torch.Tensor,
                          rstd: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    dx, dw = _backward(dy, ds_out, as_rows(s), weight, rstd)
    return dx.view(s.shape), dw


@_rms_norm_backward_op.register_fake
def _(dy, ds_out, s, weight, rstd):
    return s.new_empty(s.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, residual, _ = inputs
    _, s, rstd = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(s if ctx.has_residual else x, weight, rstd)


def _op_backward(ctx, dy, ds_out, _drstd):
    s, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward_op(dy, ds_out if ctx.has_residual else None, s, weight, rstd)
    return dx, dw, (dx if ctx.has_residual else None), None


_rms_norm_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


#: how a compiled graph computes the norm (``rms_norm(..., compiled=)``)
COMPILED_FORMS = ("inductor", "kernel")


def check_compiled_form(compiled: str, where: str) -> str:
    """``compiled`` if it is one of :data:`COMPILED_FORMS`, else a ScheduleValueError naming ``where``."""
    if compiled not in COMPILED_FORMS:
        raise ScheduleValueError(f"{where}: compiled={compiled!r} is not a form of the norm under torch.compile: "
                                 f"expected one of {COMPILED_FORMS}")
    return compiled


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: Optional[torch.Tensor] = None,
             compiled: str = "inductor") -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """RMSNorm over the last dimension with HF LLaMA's semantics; fused with ``residual + x`` when
    ``residual`` is given, then returning ``(y, residual + x)``.

    ``x`` of any shape ``(..., N)``, ``weight`` of shape ``(N,)``; ``y`` has the dtype of
    ``weight * x`` (HF: an fp32 weight on bf16 activations gives fp32). Runs the Triton kernels on
    CUDA (and on the CPU under ``TRITON_INTERPRET=1``), else :func:`reference`.

    Inside ``torch.compile``, ``compiled="inductor"`` (default) traces :func:`reference`, and Inductor
    generates the norm, fused with its neighbours (the residual add, the casts, the next op's input);
    ``compiled="kernel"`` puts the same kernels in the graph as two custom operators
    (``schedlang::rms_norm_forward`` / ``_backward``), which Inductor calls but cannot fuse with
    anything. In a LLaMA-1.1B training step on an H100 the operators made the step 4% slower
    (``bench/bench_train.py`` variant ``schedlang-optimize-mw-knorm``, ``bench/results/2026-11-27-train-norms.json``).

    Example::

        y = rms_norm(torch.randn(4, 7, 64), torch.ones(64), 1e-6)
    """
    check_compiled_form(compiled, "rms_norm")
    # the norm runs over the last dimension, so x and weight need one; an integer x would be normalized to zeros
    check_tensor("rms_norm", "x", x, FLOATING_DTYPES, min_dim=1)
    check_tensor("rms_norm", "weight", weight, FLOATING_DTYPES, min_dim=1)
    if residual is not None:
        check_tensor("rms_norm", "residual", residual)
    check_number("rms_norm", "eps", eps, minimum=0)
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ScheduleValueError(f"rms_norm: weight of shape {tuple(weight.shape)} does not fit inputs of shape "
                         f"{tuple(x.shape)}: expected ({x.shape[-1]},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ScheduleValueError(f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    if x.shape[-1] > MAX_HIDDEN:
        return reference(x, weight, eps, residual)
    if use_triton_for(x, weight, residual):
        return _RMSNorm.apply(x, weight, residual, float(eps))
    if (compiled == "kernel" and torch.compiler.is_compiling()
            and use_triton_for(x, weight, residual, while_compiling=True)):
        y, s, _ = _rms_norm_forward_op(x, weight, residual, float(eps))
        return y if residual is None else (y, s)
    return reference(x, weight, eps, residual)

"""SwiGLU, ``silu(gate) * up``, fused: one Triton kernel forward, one backward.

Maths per element (fp32 inside, one rounding at the store)::

    sig = 1 / (1 + exp(-g))
    y   = g * sig * u
    dg  = dy * u * sig * (1 + g * (1 - sig))      # d silu(g) / dg = sig + g sig (1 - sig)
    du  = dy * g * sig

Bytes moved per element (2-byte dtypes): forward reads g, u and writes y: 6 bytes; backward reads
dy, g, u and writes dg, du: 10 bytes. Eager PyTorch runs silu and the product as two kernels
forward (10 bytes) and four or more backward, and saves silu(g) besides g and u; this saves only
g and u and recomputes the sigmoid (free: the kernel is memory bound).

Launch shape: a flat loop over the elements, ``BLOCK`` per program, autotuned on the size.

Example::

    h = swiglu(gate_proj(x), up_proj(x))
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from schedlang.argument_checks import FLOATING_DTYPES, check_tensor
from schedlang.errors import ScheduleValueError
from schedlang.kernels.row_kernels import cast_rounded, triton_dtype, tuned, use_triton_for
from schedlang.kernels.swiglu_reference import swiglu_reference

__all__ = ["swiglu", "reference"]

reference = swiglu_reference


@triton.jit
def _swiglu_forward_kernel(g_ptr, u_ptr, y_ptr, n_elements, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + offs, cast_rounded(y, DTYPE), mask=mask)


@triton.jit
def _swiglu_backward_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_elements, DTYPE: tl.constexpr,
                            BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(du_ptr + offs, cast_rounded(dy * silu, DTYPE), mask=mask)
    tl.store(dg_ptr + offs, cast_rounded(dy * u * (sig + silu * (1.0 - sig)), DTYPE), mask=mask)


_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8))]
_FORWARD = tuned(_swiglu_forward_kernel, _CONFIGS, key=["n_elements"])
_BACKWARD = tuned(_swiglu_backward_kernel, _CONFIGS, key=["n_elements"])
_INTERPRETER_META = {"BLOCK": 4096}


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _FORWARD.launch(lambda meta: (triton.cdiv(n, meta["BLOCK"]),), gate, up, y, n,
                            DTYPE=triton_dtype(gate.dtype), interpreter_meta=_INTERPRETER_META)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _BACKWARD.launch(lambda meta: (triton.cdiv(n, meta["BLOCK"]),), dy, gate, up, dg, du, n,
                             DTYPE=triton_dtype(gate.dtype), interpreter_meta=_INTERPRETER_META)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one kernel each way (gate and up of the same shape and dtype).

    Runs the Triton kernels on CUDA (and on the CPU under ``TRITON_INTERPRET=1``), else
    :func:`reference`.

    Example::

        h = swiglu(torch.randn(7, 13), torch.randn(7, 13))
    """
    check_tensor("swiglu", "gate", gate, FLOATING_DTYPES)
    check_tensor("swiglu", "up", up, FLOATING_DTYPES)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ScheduleValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
                                 f"{up.dtype} must have the same shape and dtype")
    if not use_triton_for(gate, up):
        return reference(gate, up)
    return _SwiGLU.apply(gate, up)

"""Rotary position embedding of q and k in one Triton kernel, forward and backward.

Maths (HF LLaMA's ``rotate_half`` convention; ``x1``, ``x2`` the two halves of a head's D values,
``c1, c2, s1, s2`` the halves of cos and sin at the same position)::

    forward:  o1 = x1 c1 - x2 s1            o2 = x2 c2 + x1 s2
    backward: d1 = g1 c1 + g2 s2            d2 = g2 c2 - g1 s1
              (rotate_half's transpose is -rotate_half: dx = g cos - rotate_half(g sin))

computed in fp32 and rounded once (eager PyTorch rounds q*cos, rotate_half(q)*sin and their sum).

Bytes moved (2-byte dtypes): each element of q and k is read and written once (4 bytes), and cos /
sin are read once per program for all heads: ``4 * D`` bytes per position instead of per head.
Eager PyTorch makes the rotate_half copy, two products and a sum per tensor (about 20 bytes per
element) and the same again backward.

Launch shape: a program owns ``BLOCK_S`` positions of one sequence, loads their cos and sin once,
then walks the heads of q and of k. Any strides are accepted for q and k (HF's (B, S, H, D) ->
(B, H, S, D) transpose is a view), as long as the last dimension is contiguous; cos / sin with a
batch of 1 broadcast with a zero stride. Autotuned on (D, heads).

Example::

    q, k = apply_rotary(q, k, cos, sin)      # q (B, Hq, S, D), k (B, Hk, S, D), cos/sin (B, S, D)
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from schedlang.argument_checks import FLOATING_DTYPES, check_tensor
from schedlang.errors import ScheduleValueError
from schedlang.kernels.rotary_reference import apply_rotary_reference
from schedlang.kernels.row_kernels import cast_rounded, next_power_of_2, triton_dtype, tuned, use_triton_for

__all__ = ["apply_rotary", "reference"]

reference = apply_rotary_reference


@triton.jit
def _rotate_heads(x_ptr, o_ptr, heads, sxb, sxh, sxs, sob, soh, sos, b, pos, half_cols, mask,
                  c1, c2, s1, s2, HALF, BACKWARD: tl.constexpr, OUT_DTYPE: tl.constexpr):
    x_base = x_ptr + b * sxb + pos[:, None] * sxs + half_cols[None, :]
    o_base = o_ptr + b * sob + pos[:, None] * sos + half_cols[None, :]
    for h in range(heads):
        xp = x_base + h * sxh
        x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            o1 = x1 * c1 + x2 * s2
            o2 = x2 * c2 - x1 * s1
        else:
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
        op = o_base + h * soh
        tl.store(op, cast_rounded(o1, OUT_DTYPE), mask=mask)
        tl.store(op + HALF, cast_rounded(o2, OUT_DTYPE), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, S, HALF, Hq, Hk,
                   sqb, sqh, sqs, skb, skh, sks, sqob, sqoh, sqos, skob, skoh, skos, scb, scs, ssb, sss,
                   BACKWARD: tl.constexpr, Q_OUT_DTYPE: tl.constexpr, K_OUT_DTYPE: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    half_cols = tl.arange(0, BLOCK_HALF)
    mask = (pos < S)[:, None] & (half_cols < HALF)[None, :]
    pos = pos.to(tl.int64)
    c_ptr = cos_ptr + b * scb + pos[:, None] * scs + half_cols[None, :]
    s_ptr = sin_ptr + b * ssb + pos[:, None] * sss + half_cols[None, :]
    c1 = tl.load(c_ptr, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, qo_ptr, Hq, sqb, sqh, sqs, sqob, sqoh, sqos, b, pos, half_cols, mask,
                  c1, c2, s1, s2, HALF, BACKWARD, Q_OUT_DTYPE)
    _rotate_heads(k_ptr, ko_ptr, Hk, skb, skh, sks, skob, skoh, skos, b, pos, half_cols, mask,
                  c1, c2, s1, s2, HALF, BACKWARD, K_OUT_DTYPE)


_KERNEL = tuned(
    _rotary_kernel,
    [triton.Config({"BLOCK_S": s}, num_warps=w) for s, w in ((1, 1), (2, 2), (4, 2), (4, 4), (8, 4), (16, 4))],
    key=["HALF", "Hq", "Hk"])
_INTERPRETER_META = {"BLOCK_S": 32}


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(q, k, cos, sin, q_out, k_out, backward: bool) -> None:
    batch, _, seq, dim = q.shape
    half = dim // 2
    cos, sin = cos.expand(batch, seq, dim), sin.expand(batch, seq, dim)
    if batch * seq == 0:
        return
    _KERNEL.launch(
        lambda meta: (batch, triton.cdiv(seq, meta["BLOCK_S"])),
        q, k, cos, sin, q_out, k_out, seq, half, q.shape[1], k.shape[1],
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        BACKWARD=backward, Q_OUT_DTYPE=triton_dtype(q_out.dtype), K_OUT_DTYPE=triton_dtype(k_out.dtype),
        BLOCK_HALF=next_power_of_2(half), interpreter_meta=_INTERPRETER_META)


def _empty_like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An output with ``x``'s strides when they are dense (keeps HF's transposed layout), else contiguous."""
    return torch.empty_like(x, dtype=dtype)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
        cos, sin = _last_dim_contiguous(cos), _last_dim_contiguous(sin)
        q_out = _empty_like(q, torch.promote_types(q.dtype, cos.dtype))
        k_out = _empty_like(k, torch.promote_types(k.dtype, cos.dtype))
        _launch(q, k, cos, sin, q_out, k_out, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = (q.dtype, k.dtype)
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        q_dtype, k_dtype = ctx.dtypes
        dq_out = _last_dim_contiguous(dq_out)
        dk_out = _last_dim_contiguous(dk_out)
        dq = _empty_like(dq_out, q_dtype)
        dk = _empty_like(dk_out, k_dtype)
        _launch(dq_out, dk_out, cos, sin, dq, dk, backward=True)
        return dq, dk, None, None


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q`` (B, Hq, S, D) and ``k`` (B, Hk, S, D) with ``cos`` / ``sin`` of
    shape (B or 1, S, D) broadcast over the heads, as HF LLaMA's ``apply_rotary_pos_emb``.

    Grouped-query attention (Hk < Hq) is fine. cos and sin are constants (no gradient flows to
    them; when they require one, :func:`reference` runs instead). Runs the Triton kernel on CUDA
    (and on the CPU under ``TRITON_INTERPRET=1``), else :func:`reference`.

    Example::

        q, k = apply_rotary(torch.randn(2, 4, 7, 64), torch.randn(2, 1, 7, 64), cos, sin)
    """
    for name, value in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_tensor("apply_rotary", name, value, FLOATING_DTYPES)
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        raise ScheduleValueError(
            f"apply_rotary: expected q (B, Hq, S, D), k (B, Hk, S, D) and cos/sin (B, S, D), got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    batch, _, seq, dim = q.shape
    if (k.shape[0] != batch or k.shape[2:] != q.shape[2:] or cos.shape[1:] != (seq, dim)
            or cos.shape[0] not in (1, batch) or dim % 2):
        raise ScheduleValueError(
            f"apply_rotary: shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, cos/sin {tuple(cos.shape)}; "
            f"k needs q's batch, sequence and (even) head size, cos/sin ({batch} or 1, {seq}, {dim})")
    if (not use_triton_for(q, k, cos, sin) or cos.requires_grad or sin.requires_grad
            or len({q.dtype, k.dtype}) != 1):
        return reference(q, k, cos, sin)
    return _Rotary.apply(q, k, cos, sin)

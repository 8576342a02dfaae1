"""Linear layer + cross entropy, chunked over tokens so the full logits never exist.

The LM head of a 32k-vocabulary model on 8192 tokens makes 8192 x 32000 logits: 0.5 GB in bf16,
1 GB more for HF's fp32 upcast, and as much again for their gradient. Here the tokens go through
in chunks of ``C``; for each chunk::

    z   = x_c @ W^T (+ b)                         # (C, V) logits, torch matmul (cuBLAS)
    lse = log(sum_j exp(z_j))                     # Triton: one online pass (running max, rescaled sum)
    loss_i = lse_i - z_i,t_i                      # 0 for tokens whose target is ignore_index
    z  <- softmax(z) - onehot(t)                  # Triton, second pass: the gradient of the
                                                  #   summed loss wrt the logits, written in place
    dx_c = z @ W ;  dW += z^T @ x_c ;  db += sum_i z_i      # torch matmuls

so only one chunk of logits is alive at a time, and the backward pass is already done when the
forward returns: backward only scales the stored dx, dW, db by the incoming gradient (and by
``1 / valid tokens`` for ``reduction="mean"``). ``reduction="none"`` needs a per-token scale inside
the GEMMs, so there the forward keeps only ``lse`` and backward recomputes the logits chunk by chunk.

Bytes moved by the Triton kernel per chunk (2-byte logits): the logits are read twice (the
statistics pass, then the gradient pass, which often hits L2) and written once: ``6 C V`` bytes,
against eager's fp32 copy, softmax, loss and gradient kernels (about ``30 C V``). The GEMMs cost
``6 C V H`` FLOPs per chunk (forward, dx, dW), the same as unchunked.

A chunk's logits live in a buffer whose rows are padded to a multiple of 16 elements (``ROW_ALIGNMENT``): with
an odd vocabulary (GPT-2's 50257) unpadded rows would start off 16-byte boundaries, and both the Triton
kernels' loads and cuBLAS's accesses of the logits would lose their vector width.

``dW`` accumulates in the weight's dtype across chunks (cuBLAS adds in fp32 and rounds once per
chunk); with the default chunking of a few large chunks that is a few roundings.

The vocabulary-parallel variant (:mod:`vocab_parallel_fused_linear_cross_entropy`) runs the same
loop on a vocabulary slice per rank: the statistics pass gives each rank's row max, sum of
exponentials and target logit, which are combined over the group (one MAX and one SUM
all-reduce of ``2 C`` values) before the gradient pass.

Example::

    loss = fused_linear_cross_entropy(hidden, lm_head.weight, labels)     # hidden (B, S, H)
    loss.backward()
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from schedlang.argument_checks import FLOATING_DTYPES, check_int, check_integer_tensor, check_tensor
from schedlang.errors import ScheduleValueError
from schedlang.kernels.fused_linear_cross_entropy_reference import fused_linear_cross_entropy_reference
from schedlang.kernels.row_kernels import (as_rows, cast_rounded, interpreting, next_power_of_2, triton_dtype,
                                           use_triton_for)

__all__ = ["fused_linear_cross_entropy", "reference", "default_chunk_size", "check_arguments", "LinearCrossEntropy",
           "REDUCTIONS"]

logger = logging.getLogger("schedlang.kernels.fused_linear_cross_entropy")
reference = fused_linear_cross_entropy_reference

REDUCTIONS = ("mean", "sum", "none")
#: a chunk's logits rows start every this many elements (the last ones of a row unused when the vocabulary is
#: not a multiple): Triton specializes an integer argument divisible by 16, so the kernels' loads of a row are
#: vectorized, and cuBLAS writes and reads rows on 16-byte boundaries
ROW_ALIGNMENT = 16
#: bytes of logits per chunk that the default chunk size aims at
CHUNK_BYTES = 256 * 2 ** 20


# ------------------------------------------------------------------------------------------- kernels
@triton.jit
def _statistics_block(base, cols, col_ok, local_target, row_max, sum_exp, target_logit):
    """One block of a row into the online max, the rescaled sum of exponentials and the target's logit.
    ``col_ok`` is None for a block wholly inside the row: its loads are unmasked, so they stay vectorized."""
    if col_ok is None:
        z = tl.load(base + cols[None, :]).to(tl.float32)
        is_target = cols[None, :] == local_target[:, None]
    else:
        z = tl.load(base + cols[None, :], mask=col_ok[None, :], other=float("-inf")).to(tl.float32)
        # a target past this slice's end may fall in the padding of the last block (where z = -inf)
        is_target = (cols[None, :] == local_target[:, None]) & col_ok[None, :]
    new_max = tl.maximum(row_max, tl.max(z, axis=1))
    sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(z - new_max[:, None]), axis=1)
    target_logit += tl.sum(tl.where(is_target, z, 0.0), axis=1)
    return new_max, sum_exp, target_logit


@triton.jit
def _row_statistics(z_ptr, stride, rows, target, V, vocab_start, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """Online max, sum of exp(z - max) and the target's logit (0 when outside [vocab_start, +V)).

    Whole blocks are read without a mask: a mask bounded by a vocabulary that is not a multiple of 16 (GPT-2's
    50257) would make every load of the row a scalar one. Only the last, partial block is masked."""
    local_target = target - vocab_start
    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    sum_exp = tl.zeros((BLOCK_M,), dtype=tl.float32)
    target_logit = tl.zeros((BLOCK_M,), dtype=tl.float32)
    base = z_ptr + rows.to(tl.int64)[:, None] * stride
    full = V // BLOCK_V * BLOCK_V
    for start in range(0, full, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        row_max, sum_exp, target_logit = _statistics_block(base, cols, None, local_target, row_max, sum_exp,
                                                           target_logit)
    if full < V:
        cols = full + tl.arange(0, BLOCK_V)
        row_max, sum_exp, target_logit = _statistics_block(base, cols, cols < V, local_target, row_max, sum_exp,
                                                           target_logit)
    return row_max, sum_exp, target_logit


@triton.jit
def _gradient_block(base, cols, col_ok, row_ok, local_target, valid, lse, scale, DTYPE: tl.constexpr):
    """One block of a row's logits replaced by their gradient (``col_ok`` None: a whole block, unmasked loads)."""
    if col_ok is None:
        z = tl.load(base + cols[None, :]).to(tl.float32)
        store_ok = row_ok[:, None] & (cols[None, :] >= 0)
    else:
        z = tl.load(base + cols[None, :], mask=col_ok[None, :], other=0.0).to(tl.float32)
        store_ok = row_ok[:, None] & col_ok[None, :]
    grad = tl.exp(z - lse[:, None]) - tl.where(cols[None, :] == local_target[:, None], 1.0, 0.0)
    grad = tl.where(valid[:, None], grad * scale[:, None], 0.0)
    tl.store(base + cols[None, :], cast_rounded(grad, DTYPE), mask=store_ok)


@triton.jit
def _write_row_gradients(z_ptr, stride, rows, row_ok, target, valid, lse, scale, V, vocab_start,
                         DTYPE: tl.constexpr, BLOCK_V: tl.constexpr):
    """z <- (softmax(z) - onehot(target)) * scale, in place; 0 on rows whose target is ignored. Whole blocks
    unmasked along the row, as in :func:`_row_statistics`."""
    local_target = target - vocab_start
    base = z_ptr + rows.to(tl.int64)[:, None] * stride
    full = V // BLOCK_V * BLOCK_V
    for start in range(0, full, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        _gradient_block(base, cols, None, row_ok, local_target, valid, lse, scale, DTYPE)
    if full < V:
        cols = full + tl.arange(0, BLOCK_V)
        _gradient_block(base, cols, cols < V, row_ok, local_target, valid, lse, scale, DTYPE)


@triton.jit
def _rows_of_program(target_ptr, M, ignore_index, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows = tl.minimum(rows, M - 1)  # padding rows re-read the last row; nothing of theirs is stored
    target = tl.load(target_ptr + rows).to(tl.int64)
    return rows, row_ok, target, target != ignore_index


@triton.jit
def _cross_entropy_kernel(z_ptr, stride, target_ptr, loss_ptr, lse_ptr, M, V, ignore_index,
                          WRITE_GRAD: tl.constexpr, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_V: tl.constexpr):
    """Whole vocabulary on this device: loss and lse per row, and (WRITE_GRAD) the unscaled gradient."""
    rows, row_ok, target, valid = _rows_of_program(target_ptr, M, ignore_index, BLOCK_M)
    row_max, sum_exp, target_logit = _row_statistics(z_ptr, stride, rows, target, V, 0, BLOCK_M, BLOCK_V)
    lse = row_max + tl.log(sum_exp)
    tl.store(loss_ptr + rows, tl.where(valid, lse - target_logit, 0.0), mask=row_ok)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    if WRITE_GRAD:
        ones = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
        _write_row_gradients(z_ptr, stride, rows, row_ok, target, valid, lse, ones, V, 0, DTYPE, BLOCK_V)


@triton.jit
def _statistics_kernel(z_ptr, stride, target_ptr, stats_ptr, M, V, vocab_start, ignore_index,
                       BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """A vocabulary slice: stats (3, M) = this slice's row max, sum of exp(z - max), target logit."""
    rows, row_ok, target, valid = _rows_of_program(target_ptr, M, ignore_index, BLOCK_M)
    row_max, sum_exp, target_logit = _row_statistics(z_ptr, stride, rows, target, V, vocab_start, BLOCK_M, BLOCK_V)
    tl.store(stats_ptr + rows, row_max, mask=row_ok)
    tl.store(stats_ptr + M + rows, sum_exp, mask=row_ok)
    tl.store(stats_ptr + 2 * M + rows, target_logit, mask=row_ok)


@triton.jit
def _gradient_kernel(z_ptr, stride, target_ptr, lse_ptr, scale_ptr, M, V, vocab_start, ignore_index,
                     HAS_SCALE: tl.constexpr, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """Gradient of the logits from a known lse (global over the vocabulary), times a per-row scale."""
    rows, row_ok, target, valid = _rows_of_program(target_ptr, M, ignore_index, BLOCK_M)
    lse = tl.load(lse_ptr + rows)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + rows).to(tl.float32)
    else:
        scale = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    _write_row_gradients(z_ptr, stride, rows, row_ok, target, valid, lse, scale, V, vocab_start, DTYPE, BLOCK_V)


def rows_aligned(logits: torch.Tensor) -> bool:
    """Whether every row of ``logits`` starts on a 16-byte boundary (what :func:`_launch_shape` asks)."""
    return logits.stride(0) * logits.element_size() % 16 == 0


def _launch_shape(vocab: int, aligned_rows: bool = True) -> dict:
    """Rows per program, vocabulary block and warps. On the GPU one program streams one row in blocks
    of up to 2048 logits, with 4 warps, or 8 where a row does not start on a 16-byte boundary
    (``aligned_rows=False``, :func:`rows_aligned`: an odd vocabulary such as GPT-2's 50257 in rows that
    :func:`_logits` left unpadded, under autocast to another dtype): such a row's loads cannot be
    vectorized, and more warps keep more of them in flight. The interpreter takes many rows per program (it runs
    programs serially).

    Measured on an H200 (``bench/probe_loss_kernel.py``: 4096 rows, bf16, ms per call of the loss
    kernel): vocabulary 32000, 0.269 in blocks of 2048 with 4 warps against 0.309 in blocks of 8192 with
    16; 128256, 1.046 against 1.227; 50257, 0.660 with 8 warps against 1.232. The statistics and gradient
    kernels of a vocabulary slice gain as much or less (slices of 16000 to 64128: 2 to 21%). With whole
    blocks unmasked (another H200): 50257 in padded rows 0.482 with 4 warps, against 0.604 with 8 in
    unpadded ones; a slice of 25128 in padded rows 0.266 against 0.328 (its stride, a multiple of 8 but
    not of 16, is one Triton cannot take as aligned)."""
    block_v = min(2048 if not interpreting() else 1024, next_power_of_2(vocab))
    if interpreting():
        return {"BLOCK_M": max(1, min(64, 4096 // block_v)), "BLOCK_V": block_v}
    return {"BLOCK_M": 1, "BLOCK_V": block_v, "num_warps": 4 if aligned_rows or block_v < 2048 else 8}


# ------------------------------------------------------------------------------------- the chunk loop
def default_chunk_size(tokens: int, vocab: int, dtype: torch.dtype) -> int:
    """Tokens per chunk: about :data:`CHUNK_BYTES` of logits, split evenly over the chunks, a multiple of 8."""
    max_rows = max(8, CHUNK_BYTES // max(1, vocab * torch.empty((), dtype=dtype).element_size()))
    chunks = max(1, -(-tokens // max_rows))
    return max(1, min(tokens, -(-(-(-tokens // chunks)) // 8) * 8))


def _group_rank(group) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What the chunk loop needs to know besides the tensors."""
    chunk: int
    ignore_index: int
    group: Optional[object] = None  # a process group holding vocabulary slices; None: whole vocabulary
    vocab_start: int = 0            # first vocabulary id of this rank's slice
    reduce_hidden_grad: bool = True  # sum the partial hidden gradients of the slices over the group

    @property
    def sliced(self) -> bool:
        return self.group is not None


def _chunk_cross_entropy(setup, logits, target, loss, lse, write_grad, scale=None):
    """Loss and lse of one chunk's rows into ``loss`` / ``lse``; with ``write_grad`` the logits
    become their gradient in place (times ``scale`` per row when given). Without ``loss`` the
    gradient is recomputed from the given ``lse``."""
    rows, vocab = logits.shape
    shape = _launch_shape(vocab, aligned_rows=rows_aligned(logits))
    grid = (triton.cdiv(rows, shape["BLOCK_M"]),)
    dtype = triton_dtype(logits.dtype)
    if not setup.sliced and loss is not None and scale is None:
        _cross_entropy_kernel[grid](logits, logits.stride(0), target, loss, lse, rows, vocab, setup.ignore_index,
                                    WRITE_GRAD=write_grad, DTYPE=dtype, **shape)
        return
    if loss is not None:  # statistics of the slices, combined over the group
        stats = torch.empty((3, rows), dtype=torch.float32, device=logits.device)
        _statistics_kernel[grid](logits, logits.stride(0), target, stats, rows, vocab, setup.vocab_start,
                                 setup.ignore_index, **shape)
        row_max = stats[0].clone()
        if _group_size(setup.group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=setup.group)
        sums = torch.stack([stats[1] * torch.exp(stats[0] - row_max), stats[2]])
        if _group_size(setup.group) > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=setup.group)
        lse.copy_(row_max + torch.log(sums[0]))
        loss.copy_(torch.where(target != setup.ignore_index, lse - sums[1], torch.zeros_like(lse)))
    if write_grad:
        _gradient_kernel[grid](logits, logits.stride(0), target, lse, scale if scale is not None else lse, rows,
                               vocab, setup.vocab_start, setup.ignore_index, HAS_SCALE=scale is not None,
                               DTYPE=dtype, **shape)


def padded_width(vocab: int) -> int:
    """The row stride, in elements, of a chunk's logits: ``vocab`` rounded up to :data:`ROW_ALIGNMENT`."""
    return -(-vocab // ROW_ALIGNMENT) * ROW_ALIGNMENT


def _logits(x_c, weight, bias):
    """``x_c @ weight.t() (+ bias)``: the first ``vocab`` columns of a buffer whose rows are padded to
    :data:`ROW_ALIGNMENT` elements, so that an odd vocabulary (GPT-2's 50257) gets aligned rows too. Under
    autocast to another dtype than the operands' the matmul keeps autocast's casts (an ``out=`` matmul would
    skip them), and its rows are not padded."""
    vocab = weight.shape[0]
    width = padded_width(vocab)
    device_type = x_c.device.type
    casts = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) != x_c.dtype
    if width == vocab or casts:
        return torch.addmm(bias, x_c, weight.t()) if bias is not None else x_c @ weight.t()
    buffer = torch.empty((x_c.shape[0], width), dtype=x_c.dtype, device=x_c.device)
    # the padding is zeroed: a matmul may read it (the CPU's bf16 GEMM does, and a NaN there leaks into dx)
    buffer[:, vocab:].zero_()
    out = buffer[:, :vocab]
    if bias is not None:
        return torch.addmm(bias, x_c, weight.t(), out=out)
    return torch.mm(x_c, weight.t(), out=out)


def _run_chunks(setup, x, weight, bias, target, need, loss=None, lse=None, scale=None):
    """The chunk loop. ``need`` = (dx, dW, db) wanted. With ``loss`` given, computes loss / lse rows
    (and the gradients when any is needed); without, recomputes gradients from ``lse`` and ``scale``."""
    tokens = x.shape[0]
    write_grad = any(need)
    dx = torch.empty_like(x) if need[0] else None
    dw = None
    db = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if need[2] else None
    for start in range(0, tokens, setup.chunk):
        end = min(tokens, start + setup.chunk)
        x_c = x[start:end]
        logits = _logits(x_c, weight, bias)
        _chunk_cross_entropy(setup, logits, target[start:end], loss[start:end] if loss is not None else None,
                             lse[start:end], write_grad, scale[start:end] if scale is not None else None)
        if not write_grad:
            continue
        if dx is not None:
            torch.mm(logits, weight, out=dx[start:end])
        if need[1]:
            if dw is None:
                dw = logits.t() @ x_c
            else:
                dw.addmm_(logits.t(), x_c)
        if db is not None:
            db += logits.sum(0, dtype=torch.float32)
    if need[1] and dw is None:
        dw = torch.zeros_like(weight)
    if dx is not None and setup.reduce_hidden_grad and _group_size(setup.group) > 1:
        dist.all_reduce(dx, op=dist.ReduceOp.SUM, group=setup.group)
    return dx, dw, db


class LinearCrossEntropy(torch.autograd.Function):
    """The autograd function of both variants (``group=None``: the whole vocabulary here)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, reduction, chunk_size, group, reduce_hidden_grad):
        x = as_rows(hidden)
        t = target.reshape(-1).contiguous()
        tokens, vocab = x.shape[0], weight.shape[0]
        setup = _Setup(chunk=chunk_size or default_chunk_size(tokens, vocab, x.dtype), ignore_index=int(ignore_index),
                       group=group, vocab_start=_group_rank(group) * vocab, reduce_hidden_grad=reduce_hidden_grad)
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        precompute = reduction != "none" and any(need)
        loss_rows = torch.empty(tokens, dtype=torch.float32, device=x.device)
        lse = torch.empty(tokens, dtype=torch.float32, device=x.device)
        grads = _run_chunks(setup, x, weight, bias, t, need if precompute else (False,) * 3, loss=loss_rows, lse=lse)
        ctx.setup, ctx.reduction, ctx.precomputed, ctx.need = setup, reduction, precompute, need
        ctx.hidden_shape = hidden.shape
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.grad_scale = None
        if reduction == "mean":
            count = (t != ignore_index).sum().to(torch.float32)
            ctx.grad_scale = 1.0 / count
            loss = loss_rows.sum() / count
        elif reduction == "sum":
            loss = loss_rows.sum()
        else:
            loss = loss_rows.view(target.shape)
        if precompute:
            ctx.grads = grads
        elif reduction == "none" and any(need):
            ctx.save_for_backward(x, weight, bias, t, lse)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.precomputed:
            if not hasattr(ctx, "grads"):
                raise RuntimeError("fused_linear_cross_entropy: backward ran twice through the same forward; "
                                   "its gradients are computed in the forward and handed out once")
            dx, dw, db = ctx.grads
            del ctx.grads
            factor = grad_loss.to(torch.float32)
            if ctx.grad_scale is not None:
                factor = factor * ctx.grad_scale
        else:
            x, weight, bias, t, lse = ctx.saved_tensors
            scale = grad_loss.reshape(-1).to(torch.float32).contiguous()
            dx, dw, db = _run_chunks(ctx.setup, x, weight, bias, t, ctx.need, lse=lse, scale=scale)
            factor = None

        if factor is not None:
            _scale_in_place([g for g in (dx, dw, db) if g is not None], factor)
        dx = dx.view(ctx.hidden_shape) if dx is not None else None
        db = db.to(ctx.bias_dtype) if db is not None else None
        return dx, dw, db, None, None, None, None, None, None


def _scale_in_place(grads, factor: torch.Tensor) -> None:
    """Multiply the gradients (this function's own buffers) by the 0-d ``factor`` in place, one foreach launch
    per dtype. ``g * factor`` with a 0-d device tensor is a broadcasting kernel that does not vectorize: on an
    H200 it took 149 us for a 32000 x 2048 bf16 weight gradient, about a third of the memory's speed. The
    foreach kernel takes its scalar in the tensors' dtype and multiplies in fp32, as ``g * factor.to(g.dtype)``
    does."""
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, group in by_dtype.items():
        torch._foreach_mul_(group, factor.to(dtype))


def check_arguments(name: str, hidden, weight, target, reduction, chunk_size, bias, ignore_index: int = -100,
                    vocab_slices: int = 1) -> None:
    """Types, dtypes, shapes, options and target ids of both variants; raises
    :class:`~schedlang.errors.ScheduleValueError`. ``weight`` holds one of ``vocab_slices`` equal slices of the
    vocabulary (its rows), so the targets may name ``vocab_slices x rows`` classes."""
    check_tensor(name, "hidden", hidden, FLOATING_DTYPES, min_dim=1)
    check_tensor(name, "weight", weight, FLOATING_DTYPES)
    check_integer_tensor(name, "target", target)
    if bias is not None:
        check_tensor(name, "bias", bias, FLOATING_DTYPES)
    check_int(name, "ignore_index", ignore_index)
    # the projection runs in one dtype; under autocast the reference's F.linear casts its operands itself
    if not torch.is_autocast_enabled(hidden.device.type):
        dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
        if len(dtypes) > 1:
            with_bias = f", bias {bias.dtype}" if bias is not None else ""
            raise ScheduleValueError(f"{name}: hidden {hidden.dtype}, weight {weight.dtype}{with_bias} must have the "
                                     f"same dtype: cast hidden to the weight's dtype (or run under torch.autocast)")
    if reduction not in REDUCTIONS:
        raise ScheduleValueError(f"{name}: invalid reduction {reduction!r}: valid are {', '.join(REDUCTIONS)}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ScheduleValueError(f"{name}: weight of shape {tuple(weight.shape)} does not fit hidden of shape "
                                 f"{tuple(hidden.shape)}: expected (vocab, {hidden.shape[-1]})")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ScheduleValueError(f"{name}: target of shape {tuple(target.shape)} does not fit hidden of shape "
                                 f"{tuple(hidden.shape)}: expected {tuple(hidden.shape[:-1])}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ScheduleValueError(f"{name}: bias of shape {tuple(bias.shape)} does not fit weight of shape "
                                 f"{tuple(weight.shape)}: expected ({weight.shape[0]},)")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ScheduleValueError(f"{name}: chunk_size must be a positive int (tokens per chunk) or None, "
                                 f"got {chunk_size!r}")
    _check_target_ids(name, target, weight.shape[0] * vocab_slices, ignore_index)


def _check_target_ids(name: str, target: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Every target id is a class of the vocabulary, ``[0, vocab_size)``, or ``ignore_index``."""
    # An id outside the vocabulary makes no error in the Triton kernels (its logit reads as 0: the loss would
    # be silently wrong). On the CPU the ids are checked on the host, with a clear error. On a GPU a host read
    # would stall the step in the middle of its forward (the host waits for the GPU, and the backward's
    # launches start late), so the check stays on the device, as torch's own cross_entropy does: an id outside
    # the vocabulary stops the GPU with a device-side assert. Skipped while torch.compile traces (the traced
    # reference's cross_entropy checks the ids) and while a CUDA graph is captured.
    if target.numel() == 0 or torch.compiler.is_compiling():
        return
    counted = target.masked_fill(target == ignore_index, 0)
    if target.device.type == "cuda":
        if not torch.cuda.is_current_stream_capturing():
            torch._assert_async(((counted >= 0) & (counted < vocab_size)).all())
        return
    low, high = torch.stack(torch.aminmax(counted)).tolist()
    if low < 0 or high >= vocab_size:
        raise ScheduleValueError(f"{name}: target holds the id {low if low < 0 else high}, outside the vocabulary: "
                                 f"valid ids are 0..{vocab_size - 1}, or ignore_index={ignore_index} for a token "
                                 "that does not count")


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               ignore_index: int = -100, reduction: str = "mean", chunk_size: Optional[int] = None,
                               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``cross_entropy(hidden @ weight^T + bias, target)`` without materializing the logits.

    ``hidden`` (..., H), ``weight`` (V, H), ``target`` (...) of class ids; ``reduction`` ``"mean"``
    (over tokens whose target is not ``ignore_index``), ``"sum"`` or ``"none"`` (a loss per token).
    The loss is fp32, as HF's upcast logits give. ``chunk_size`` tokens are processed at a time
    (default: about 256 MiB of logits per chunk). Gradients of hidden, weight and bias are computed
    during the forward pass (for "mean" and "sum"). Runs the Triton kernels on CUDA (and on the CPU
    under ``TRITON_INTERPRET=1``), else :func:`reference`.

    Example::

        loss = fused_linear_cross_entropy(hidden, lm_head.weight, labels, chunk_size=4096)
    """
    check_arguments("fused_linear_cross_entropy", hidden, weight, target, reduction, chunk_size, bias, ignore_index)
    if not use_triton_for(hidden, weight, bias) or hidden.dtype != weight.dtype or target.device != hidden.device:
        return reference(hidden, weight, target, ignore_index, reduction, chunk_size, bias)
    return LinearCrossEntropy.apply(hidden, weight, bias, target, ignore_index, reduction, chunk_size, None, True)

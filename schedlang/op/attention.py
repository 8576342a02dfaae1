"""Attention with a kernel chosen by name, on PyTorch's ``scaled_dot_product_attention``.

``attn_op_name`` picks the SDPA backend:

================================  ==============================  ==========================
name                              backend                         runs on
================================  ==============================  ==========================
``"auto"``                        PyTorch picks                   anywhere
``"math"``                        the reference (plain matmuls)   anywhere
``"flash"`` (``"cuda"``, ``"triton"``)  FlashAttention-2         CUDA sm80+, CPU
``"efficient"`` (``"cutlass"``)   memory-efficient attention      CUDA
``"cudnn"``                       cuDNN attention                 CUDA sm90 (recent builds)
================================  ==============================  ==========================

Slapo's names (``cuda``, ``triton``, ``cutlass``; ``native_flash_attn`` and ``native_xformers``
for the references) map onto these. A backend this machine or this build of PyTorch cannot
run raises :class:`AttentionKernelError` when the module is created; one that refuses the
inputs (dtype, head size, mask) raises it on the call, naming the backend and the inputs.

Layout: q, k, v are ``(batch, seq, heads, head_size)``, as in Slapo.
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SchedlangError, ScheduleValueError

__all__ = ["FlashAttentionOp", "FlashAttention", "AttentionKernelError", "flash_attn_ref", "xformers_ref",
           "validate_sm_version", "get_xfoemers_attn_op_by_name", "warning_once", "sdpa_backend", "BACKENDS"]

logger = logging.getLogger("schedlang.op.attention")


class AttentionKernelError(SchedlangError, RuntimeError):
    """The chosen attention kernel is not available here, or refuses the inputs."""


#: name -> (SDPBackend member name or None for PyTorch's choice, needs CUDA)
BACKENDS = {"auto": (None, False), "math": ("MATH", False), "flash": ("FLASH_ATTENTION", False),
            "efficient": ("EFFICIENT_ATTENTION", True), "cudnn": ("CUDNN_ATTENTION", True)}
_ALIASES = {"cuda": "flash", "triton": "flash", "cutlass": "efficient", "mem_efficient": "efficient",
            "native_flash_attn": "math", "native_xformers": "math", "xformers": "efficient", "sdpa": "auto"}

_WARNED = set()


def warning_once(msg: str) -> None:
    """Log ``msg`` as a warning the first time only."""
    if msg not in _WARNED:
        _WARNED.add(msg)
        logger.warning(msg)


def sdpa_backend(attn_op_name: str):
    """The ``torch.nn.attention.SDPBackend`` for a kernel name (None for ``auto``); raises
    :class:`AttentionKernelError` if this machine or build cannot run it."""
    name = _ALIASES.get(attn_op_name, attn_op_name)
    if name not in BACKENDS:
        raise AttentionKernelError(f"attention: unknown attention kernel {attn_op_name!r}: valid are "
                                   f"{', '.join(list(BACKENDS) + list(_ALIASES))}")
    member, needs_cuda = BACKENDS[name]
    if member is None:
        return None
    from torch.nn.attention import SDPBackend

    backend = getattr(SDPBackend, member, None)
    if backend is None:
        raise AttentionKernelError(f"attention: kernel {attn_op_name!r} ({member}) is not in this build of PyTorch "
                                   f"{torch.__version__}; valid here: auto, math, flash")
    if needs_cuda and not torch.cuda.is_available():
        raise AttentionKernelError(f"attention: kernel {attn_op_name!r} ({member}) needs a CUDA device and none is "
                                   "available; use 'flash' or 'math' (both run on the CPU) or 'auto'")
    if name == "flash" and torch.cuda.is_available() and not torch.backends.cuda.is_flash_attention_available():
        raise AttentionKernelError(f"attention: kernel {attn_op_name!r}: this PyTorch build has no FlashAttention "
                                   "for CUDA; use 'efficient', 'math' or 'auto'")
    return backend


def validate_sm_version(name: str, min_sm: Tuple[int, int], max_sm: Optional[Tuple[int, int]] = None) -> None:
    """Raise unless the current GPU's compute capability is in ``[min_sm, max_sm]``."""
    if not torch.cuda.is_available():
        raise AttentionKernelError(f"attention: {name} needs a CUDA GPU (sm_{min_sm[0]}{min_sm[1]}+); none is available")
    sm = torch.cuda.get_device_capability()
    if sm < tuple(min_sm) or (max_sm is not None and sm > tuple(max_sm)):
        allowed = f"sm_{min_sm[0]}{min_sm[1]}" + (f"-sm_{max_sm[0]}{max_sm[1]}" if max_sm else "+")
        raise AttentionKernelError(f"attention: {name} runs on {allowed} GPUs, this one is sm_{sm[0]}{sm[1]}")


def _causal_bias(q_len: int, k_len: int, dtype, device) -> torch.Tensor:
    keep = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
    return torch.zeros(q_len, k_len, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))


def flash_attn_ref(q, k, v, bias=None, causal=False, dropout_p=0.0, softmax_scale=None, query_padding_mask=None,
                   key_padding_mask=None, dropout_mask=None, upcast=True, reorder_ops=False):
    """Attention in plain PyTorch with FlashAttention's interface (the reference for checks).

    q ``(B, Sq, H, D)``, k and v ``(B, Sk, H, D)``; ``bias`` adds to the scores ``(B, H, Sq, Sk)``;
    padding masks are boolean ``(B, S)`` with True for real tokens; ``dropout_mask`` (boolean
    ``(B, H, Sq, Sk)``, True to keep) applies ``dropout_p``. Returns ``(B, Sq, H, D)``.
    """
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
    if causal:
        scores = scores + _causal_bias(scores.shape[-2], scores.shape[-1], scores.dtype, scores.device)
    probs = torch.softmax(scores, dim=-1)
    if dropout_mask is not None:
        probs = probs.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    out = torch.einsum("bhts,bshd->bthd", probs, v)
    if query_padding_mask is not None:
        out = out.masked_fill(~query_padding_mask[:, :, None, None], 0.0)
    return out.to(dtype)


def xformers_ref(q, k, v, attn_bias=None, p=0.0, scale=None):
    """Attention in plain PyTorch with xFormers' interface: ``(B, S, H, D)`` in and out."""
    return flash_attn_ref(q, k, v, bias=attn_bias, dropout_p=p, softmax_scale=scale,
                          dropout_mask=None if p == 0.0 else (torch.rand(q.shape[0], q.shape[2], q.shape[1],
                                                                         k.shape[1], device=q.device) >= p))


def get_xfoemers_attn_op_by_name(attn_name: Optional[str]):
    """xFormers' ``memory_efficient_attention`` with the operator ``attn_name`` (``cutlass``,
    ``flash``, ``triton``, ``small_k``; None or ``auto`` lets xFormers pick)."""
    from ..utils.common import importlib_or_none

    ops = importlib_or_none("xformers.ops")
    if ops is None:
        raise AttentionKernelError("attention: xformers is not installed; the same kernels are available without it through "
                                   "FlashAttentionOp('efficient' | 'flash' | 'cudnn')")
    if attn_name in (None, "auto"):
        return ops.memory_efficient_attention
    for fw, bw in ((ops.fmha.cutlass.FwOp, ops.fmha.cutlass.BwOp), (ops.fmha.flash.FwOp, ops.fmha.flash.BwOp)):
        if fw.NAME == f"{attn_name}F":
            return lambda *a, **kw: ops.memory_efficient_attention(*a, op=(fw, bw), **kw)
    raise AttentionKernelError(f"attention: unknown xformers attention op {attn_name!r}: valid are cutlass, flash, auto")


class FlashAttentionOp(nn.Module):
    """``forward(q, k, v, attention_mask, p)``: attention of ``(B, S, H, D)`` inputs with the kernel
    ``attn_op_name``; ``attention_mask`` is added to the scores (HF's ``(B, 1, 1, S)`` or
    ``(B, 1, S, S)`` additive masks, or booleans with True to keep); ``p`` is the dropout rate."""

    def __init__(self, attn_op_name: str = "auto", apply_causal_mask: bool = False, scale: Optional[float] = None):
        super().__init__()
        self.attn_op_name = attn_op_name
        self.backend = sdpa_backend(attn_op_name)
        self.apply_causal_mask = apply_causal_mask
        self.scale = scale
        self.bias_layout = "bhqk"

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, p: float = 0.0):
        q, k, v = (t.transpose(1, 2) for t in (query_layer, key_layer, value_layer))  # (B, H, S, D)
        if q.device.type == "cpu":
            # the CPU flash kernel's backward (torch 2.13) returns wrong gradients for these transposed
            # (non-contiguous) views, while its forward is right; dense copies are handled correctly
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        mask, causal = attention_mask, self.apply_causal_mask
        if mask is not None and causal:  # SDPA takes one or the other: fold the causal part into the mask
            if mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
            mask = mask.to(q.dtype) + _causal_bias(q.shape[-2], k.shape[-2], q.dtype, q.device)
            causal = False
        elif mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        p = p if self.training else 0.0
        backend = self.backend
        what = (f"q{tuple(q.shape)} {q.dtype} on {q.device} (mask: {None if mask is None else tuple(mask.shape)}, "
                f"causal: {causal}, dropout: {p})")
        if backend is not None and mask is not None and mask.requires_grad and torch.is_grad_enabled() \
                and backend.name != "MATH":
            # the fused kernels either refuse a mask that needs a gradient or (the memory-efficient one, in
            # half precision) return an inexact one: the math kernel computes it as the unfused model does
            warning_once(f"attention: kernel {self.attn_op_name!r} does not compute the gradient of an attention "
                         f"mask exactly; running {what} with the 'math' kernel")
            backend = _math_backend()
        try:
            out = _sdpa(q, k, v, mask, p, causal, self.scale, backend)
        except RuntimeError as e:
            if isinstance(e, SchedlangError) or backend is None or backend.name == "MATH":
                raise AttentionKernelError(f"attention: kernel {self.attn_op_name!r} cannot run {what}: "
                                           f"{str(e).splitlines()[0]}") from e
            # a kernel that refuses these inputs (flash with a mask, a dtype or head size it lacks on this
            # device): the math kernel runs every case
            warning_once(f"attention: kernel {self.attn_op_name!r} cannot run {what} "
                         f"({str(e).splitlines()[0]}); falling back to the 'math' kernel")
            out = _sdpa(q, k, v, mask, p, causal, self.scale, _math_backend())
        return out.transpose(1, 2)

    def extra_repr(self) -> str:
        return f"attn_op_name={self.attn_op_name!r}, apply_causal_mask={self.apply_causal_mask}"


def _math_backend():
    from torch.nn.attention import SDPBackend

    return SDPBackend.MATH


def _sdpa(q, k, v, mask, p, causal, scale, backend):
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=scale)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=scale)


class FlashAttention(nn.Module):
    """A self-attention block (projections, attention kernel, output projection) for HF-style models.

    With ``fused_qkv`` one Linear ``qkv`` computes q, k, v head by head (``(-1, 3 * head_size)``
    per head, so a shard along axis 0 keeps whole heads); otherwise ``query``, ``key``, ``value``.
    The number of heads follows the weights, so the module works unchanged after sharding.
    ``forward(hidden_states, attention_mask=None, layer_past=None, ...)`` returns
    ``(context, (k, v) if use_cache else None)``. No cross attention, head mask or attention output.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, attn_pdrop: float = 0.0, resid_pdrop: float = 0.0,
                 attn_op_name: str = "auto", bias: bool = True, output_proj: bool = True, fused_qkv: bool = False,
                 causal: Optional[bool] = None):
        super().__init__()
        if hidden_size % num_attention_heads:
            raise ScheduleValueError(f"FlashAttention: hidden_size {hidden_size} is not a multiple of "
                                     f"num_attention_heads {num_attention_heads}; hidden_size must be divisible by "
                                     "num_attention_heads")
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.all_head_size = hidden_size
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        else:
            self.query = nn.Linear(hidden_size, hidden_size, bias=bias)
            self.key = nn.Linear(hidden_size, hidden_size, bias=bias)
            self.value = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.output_proj = output_proj
        if output_proj:
            self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
            self.resid_dropout = nn.Dropout(resid_pdrop)
        self.attn_pdrop = attn_pdrop
        self.attn_op_name = attn_op_name
        # Slapo's convention: decoders (with an output projection) are causal; pass causal= to say otherwise
        self.attn_op = FlashAttentionOp(attn_op_name, output_proj if causal is None else causal)
        self.bias_layout = self.attn_op.bias_layout

    def _heads(self, x: torch.Tensor, per_head: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], -1, per_head)

    def forward(self, hidden_states, attention_mask=None, layer_past=None, head_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, use_cache=False, output_attentions=False):
        if encoder_hidden_states is not None or encoder_attention_mask is not None:
            raise ScheduleValueError("attention: FlashAttention is self-attention only: encoder_hidden_states is not supported")
        if head_mask is not None or output_attentions:
            raise ScheduleValueError("attention: FlashAttention supports neither head_mask nor output_attentions")
        d = self.attention_head_size
        if self.fused_qkv:
            q, k, v = self._heads(self.qkv(hidden_states), 3 * d).split(d, dim=-1)
        else:
            q, k, v = (self._heads(lin(hidden_states), d) for lin in (self.query, self.key, self.value))
        if layer_past is not None:
            past_k, past_v = layer_past
            k, v = torch.cat((past_k, k), dim=1), torch.cat((past_v, v), dim=1)
        context = self.attn_op(q.contiguous(), k.contiguous(), v.contiguous(), attention_mask,
                               p=self.attn_pdrop)
        context = context.reshape(*context.shape[:-2], -1)
        if self.output_proj:
            context = self.resid_dropout(self.out_proj(context))
        return context, ((k, v) if use_cache else None)

"""Bias additions fused with what follows them: GELU, dropout.

The fused forms keep only the inputs of the bias add for backward (not the sum, not the
activation's intermediates) and recompute in backward; under ``torch.compile`` each becomes
one kernel. Each has the plain PyTorch composition as its reference:

==========================  ==========================================  ======================
function                    computes                                    reference
==========================  ==========================================  ======================
``bias_gelu(x, b)``         ``gelu_tanh(x + b)``, analytic backward      ``F.gelu(x + b, approximate="tanh")``
``bias_new_gelu(x, b)``     the same (HF's ``gelu_new``)
``bias_act(x, b, act)``     ``act(x + b)``, recomputed in backward
``bias_dropout(x, b, p)``   ``dropout(x + b, p)``                       ``F.dropout(x + b, p)``
``new_gelu(x)``             ``0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))``
==========================  ==========================================  ======================
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["BiasGeLUFunction", "bias_gelu", "new_gelu", "bias_new_gelu", "bias_dropout", "bias_act", "ACTIVATIONS"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


def new_gelu(inp: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU (GPT-2's ``gelu_new``)."""
    return 0.5 * inp * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (inp + _CUBIC * torch.pow(inp, 3.0))))


class BiasGeLUFunction(torch.autograd.Function):
    """``gelu_tanh(inp + bias)``; saves ``inp`` and ``bias`` only and differentiates analytically.

    With ``u = sqrt(2/pi) (x + c x^3)`` and ``t = tanh(u)``, ``gelu(x) = x (1 + t) / 2`` and
    ``gelu'(x) = (1 + t) / 2 + x (1 - t^2) sqrt(2/pi) (1 + 3 c x^2) / 2``.
    The bias gradient is the input gradient summed over every axis but the last.
    """

    @staticmethod
    def forward(ctx, inp, bias):
        ctx.save_for_backward(inp, bias)
        return new_gelu(inp + bias)

    @staticmethod
    def backward(ctx, grad_output):
        inp, bias = ctx.saved_tensors
        wide = torch.promote_types(inp.dtype, torch.float32)  # half precision computes in float32
        x = (inp + bias).to(wide)
        t = torch.tanh(_SQRT_2_OVER_PI * (x + _CUBIC * x * x * x))
        slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _CUBIC * x * x)
        grad = grad_output.to(wide) * slope
        grad_inp = grad.to(inp.dtype) if ctx.needs_input_grad[0] else None
        grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_bias = _reduce_to(grad, bias).to(bias.dtype)
        return grad_inp, grad_bias


def _reduce_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum a broadcast gradient back to the shape of ``like``."""
    while grad.dim() > like.dim():
        grad = grad.sum(0)
    for axis, size in enumerate(like.shape):
        if size == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis, keepdim=True)
    return grad


def bias_gelu(inp: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(inp + bias)`` with the memory-saving backward of :class:`BiasGeLUFunction`."""
    return BiasGeLUFunction.apply(inp, bias)


def bias_new_gelu(inp: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return bias_gelu(inp, bias)


class _BiasActFunction(torch.autograd.Function):
    """``act(inp + bias)`` for any elementwise ``act``: saves the inputs, recomputes in backward."""

    @staticmethod
    def forward(ctx, inp, bias, act):
        ctx.act = act
        ctx.save_for_backward(inp, bias)
        return act(inp + bias)

    @staticmethod
    def backward(ctx, grad_output):
        inp, bias = ctx.saved_tensors
        with torch.enable_grad():
            x = (inp + bias).detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(ctx.act(x), x, grad_output)
        grad_bias = _reduce_to(grad, bias) if ctx.needs_input_grad[1] else None
        return (grad if ctx.needs_input_grad[0] else None), grad_bias, None


def _gelu_exact(x):
    return F.gelu(x)


#: activation names (as in HF configs) -> elementwise function
ACTIVATIONS = {"gelu": _gelu_exact, "gelu_new": new_gelu, "gelu_tanh": new_gelu, "gelu_pytorch_tanh": new_gelu,
               "relu": F.relu, "silu": F.silu, "swish": F.silu}


def bias_act(inp: torch.Tensor, bias: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``act(inp + bias)`` keeping only ``inp`` and ``bias`` for backward."""
    if act is new_gelu:
        return bias_gelu(inp, bias)
    return _BiasActFunction.apply(inp, bias, act)


def bias_dropout(x: torch.Tensor, bias: torch.Tensor, p: float = 0.5, training: bool = True,
                 inplace: bool = False) -> torch.Tensor:
    """``dropout(x + bias)``; the sum is a new tensor, so ``inplace`` only saves its copy."""
    return F.dropout(x + bias, p=p, training=training, inplace=inplace)

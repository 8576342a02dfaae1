"""What crosses a pipeline stage boundary at run time: the functions the generated stage code calls
to send activations, plain values and numbers to the next stage and to rebuild them there, and the
anchors that give every received tensor a gradient (see the package docstring)."""

from __future__ import annotations

import numbers

import torch

from ...errors import PipelineError


def _send_grad_value(value, where: str):
    """A gradient-carrying activation leaving a stage: a float tensor, sent as it is."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise PipelineError(f"pipeline: {where} is {_kind_of(value)} at run time, but was traced as a floating-point tensor; "
                            "pipeline stages can only send tensors across a cut: move the cut")
    if torch.is_grad_enabled() and not value.requires_grad:
        # an output that takes no gradient still gets one from the next stage (torch expects a
        # gradient for every float activation); give it a leaf to land on
        return value.detach().requires_grad_(True)
    return value.clone() if value._is_view() else value  # outputs may be detached in place


_FLOAT_OF = {torch.bool: torch.float32, torch.uint8: torch.float32, torch.int8: torch.float32,
             torch.int16: torch.float32, torch.int32: torch.float64, torch.int64: torch.float64}


def _send_plain_value(value, device: torch.device, where: str):
    """A value without gradient leaving a stage: as a float tensor (an empty one for None)."""
    if value is None:
        out = torch.zeros(0, dtype=torch.float32, device=device)
    elif isinstance(value, torch.Tensor):
        out = value.detach()
        if not out.is_floating_point():
            out = out.to(_FLOAT_OF.get(out.dtype, torch.float64))
        if out.dim() == 1 and out.numel() == 0:
            raise PipelineError(f"pipeline: {where} is an empty 1-D tensor, which stands for None between pipeline stages; "
                                "move the cut")
    else:
        raise PipelineError(f"pipeline: {where} is {_kind_of(value)} at run time, but was traced as a tensor or None; pipeline "
                            "stages can only send tensors across a cut: move the cut")
    return out.requires_grad_(True) if torch.is_grad_enabled() else out


def _send_number(value, device: torch.device, where: str):
    """A Python number leaving a stage. An int (a size, mostly) travels in the *shape* of an empty
    tensor, ``(0, |n|, n < 0)``: torch's stages infer shapes before the first step by sending
    zero-filled tensors of the right shapes, so a size sent as data would read 0 there."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if isinstance(value, numbers.Integral):
        n = int(value)
        out = torch.empty((0, abs(n), int(n < 0)), dtype=torch.float32, device=device)
    elif isinstance(value, numbers.Real):
        out = torch.tensor(float(value), dtype=torch.float64, device=device)
    else:
        raise PipelineError(f"pipeline: {where} is {_kind_of(value)} at run time, but was traced as a Python number; move the "
                            "cut")
    return out.requires_grad_(True) if torch.is_grad_enabled() else out


def _recv_plain_value(buffer: torch.Tensor, dtype: torch.dtype):
    if buffer.dim() == 1 and buffer.numel() == 0:
        return None
    out = buffer.detach()
    return out if out.dtype == dtype else out.to(dtype)


def _recv_number(buffer: torch.Tensor, kind: str):
    if kind == "float":
        return float(buffer.detach().item())
    n = buffer.shape[1] * (-1 if buffer.shape[2] else 1)
    return bool(n) if kind == "bool" else n


def _make_tuple(*items):
    return tuple(items)


def _make_list(*items):
    return list(items)


def _make_size(*items):
    return torch.Size(items)


def _relay(buffer: torch.Tensor) -> torch.Tensor:
    """A received value sent on to the next stage: a copy (stage outputs must not be the inputs or
    views of them; the zero-bubble schedules detach outputs in place)."""
    return buffer.clone()


# Every tensor a stage receives must get a gradient in backward (torch's stages send one back per
# received tensor), also the ones used without a gradient path (masks, position ids). Intermediate
# stages gather them into one extra 0-d output, the anchor, which the next stage receives like any
# other tensor; the last stage hangs its received tensors on its output. Backward gives them zeros.

class _AnchorScalar(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *buffers):
        ctx.metas = [(b.shape, b.dtype, b.device) for b in buffers]
        return torch.zeros((), dtype=torch.float32, device=buffers[0].device)

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.metas)


class _AnchorOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, *buffers):
        ctx.metas = [(b.shape, b.dtype, b.device) for b in buffers]
        return out.view_as(out)  # the last stage's output: never detached in place by torch

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + tuple(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.metas)


def _anchor_scalar(*buffers):
    if torch.is_grad_enabled():
        return _AnchorScalar.apply(*buffers)
    return torch.zeros((), dtype=torch.float32, device=buffers[0].device)


def _anchor_output(out, *buffers):
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise PipelineError(f"pipeline: the model output is {_kind_of(out)} at run time; the last pipeline stage must return a "
                            "floating-point tensor")
    return _AnchorOutput.apply(out, *buffers) if torch.is_grad_enabled() else out


def _kind_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
    if value is None:
        return "None"
    return f"a {type(value).__name__}"

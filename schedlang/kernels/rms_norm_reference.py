"""RMSNorm (optionally with the residual add before it) in plain PyTorch: HF LLaMA's arithmetic.

The order of casts is HuggingFace's ``LlamaRMSNorm`` exactly, so in fp32 the result is
bit-for-bit HF's, and in bf16 / fp16 it rounds where HF rounds::

    s = x + residual                      # in the input dtype (the decoder layer's residual add)
    n = s.float() * rsqrt(mean(s.float()^2) + eps)
    y = weight * n.to(input dtype)        # in promote(weight dtype, input dtype)

Example::

    y = rms_norm_reference(x, weight, 1e-6)
    y, new_residual = rms_norm_reference(x, weight, 1e-6, residual=residual)
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

__all__ = ["rms_norm_reference"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: Optional[torch.Tensor] = None
                       ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """RMSNorm of ``x`` (of ``residual + x`` when ``residual`` is given) over the last dimension.

    Returns ``y``, or ``(y, residual + x)`` with a residual (the sum feeds the next residual add).
    """
    if residual is not None:
        x = residual + x
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    y = weight * hidden.to(input_dtype)
    return y if residual is None else (y, x)

"""SwiGLU, ``silu(gate) * up``, in plain PyTorch (HF LLaMA's MLP: ``act_fn(gate_proj(x)) * up_proj(x)``).

Example::

    h = swiglu_reference(gate, up)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["swiglu_reference"]


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` element-wise, each op rounded to the dtype as eager PyTorch does."""
    return F.silu(gate) * up

"""An MLP of two Linears whose bias adds are fused: with the activation, and with the dropout."""

from __future__ import annotations

import torch
from torch import nn

from .linear import LinearWithAct, LinearWithDropout

__all__ = ["FusedMLP"]


class FusedMLP(nn.Module):
    """``dropout(fc_out(act(fc_in(x))))`` as GPT-style MLPs compute it (both Linears with bias).

    ``orig_act`` names the activation (``gelu``, ``gelu_new`` ...); ``resid_pdrop`` is the dropout
    after ``fc_out``. For tensor parallelism shard ``fc_in`` along axis 0 and ``fc_out`` along
    axis 1, and sync ``fc_out`` with ``fwd_post`` / ``all_reduce`` (the sum comes before the bias).

    Example::

        mlp = FusedMLP(768, 3072, "gelu_new", resid_pdrop=0.1)
    """

    def __init__(self, hidden_size: int, intermediate_size: int, orig_act: str, resid_pdrop: float,
                 use_torchscript: bool = False):
        super().__init__()
        self.fc_in = LinearWithAct(hidden_size, intermediate_size, act_fn=orig_act)
        self.fc_out = LinearWithDropout(intermediate_size, hidden_size, p=resid_pdrop, use_torchscript=use_torchscript)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.fc_in(hidden_states))

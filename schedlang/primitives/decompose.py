"""``decompose()``: an ``nn.Linear`` becomes a matmul followed by a separate bias add.

After ``.trace()`` the graph then shows ``linear(x, weight)`` and ``add(_, bias)`` as two
nodes, so the bias add can be fused with the activation that follows (bias + GELU).
The module is replaced by a :class:`LinearWithSeparateBias` holding the same ``Parameter``
objects, children, hooks and record, installed wherever the model holds the old one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.sync_ops import bias_after_inner_syncs, run_post_syncs
from ..errors import ScheduleTypeError, ScheduleValueError
from ..module_record import copy_module_as, module_record
from .base import Primitive, install_in_place_of, register_primitive

__all__ = ["LinearWithSeparateBias"]


class LinearWithSeparateBias(nn.Linear):
    """``nn.Linear`` whose bias is added in a separate op, after any forward-post syncs it
    runs itself (a row-parallel linear must add its bias once, after the all-reduce)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = F.linear(input, self.weight)
        if module_record(self).syncs_before_bias:
            out = run_post_syncs(self, out)
        if self.bias is not None:
            out = out + bias_after_inner_syncs(self, self.bias)
        return out


@register_primitive
class Decompose(Primitive):
    """Turn an ``nn.Linear`` into a matmul followed by a separate bias add, so that the bias
    add can be fused with what follows.

    Example::

        sch["mlp.fc1"].decompose()
    """

    name = "decompose"

    @classmethod
    def validate(cls, sch):
        module, where = sch.mod, sch.path or "<root>"
        if isinstance(module, LinearWithSeparateBias):
            raise ScheduleValueError(f"{where}: {type(module).__name__} is already decomposed (its bias is added "
                                     "separately); call decompose only once per module")
        if type(module) is not nn.Linear:
            raise ScheduleTypeError(f"{where}: decompose applies only to nn.Linear, not {type(module).__name__}")
        if module.bias is None:
            raise ScheduleValueError(f"{where}: Linear has no bias, so there is nothing to decompose (bias=False); "
                                     "decompose applies only to a Linear with a bias")
        return {}

    @classmethod
    def apply(cls, sch):
        old = sch.mod
        install_in_place_of(sch, old, copy_module_as(old, LinearWithSeparateBias))
        return None

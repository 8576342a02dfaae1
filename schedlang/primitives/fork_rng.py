"""``fork_rng()``: a per-rank random stream for this module (dropout in tensor-parallel regions).

The stream is seeded from ``torch.initial_seed() + 2718 + rank``, so results are
reproducible, differ across ranks, and leave the default stream (used by replicated parts
of the model) exactly where it would have been.
"""

from __future__ import annotations

import torch

from ..distributed.rng import FORK_OFFSET, ForkedRNG, ForkRngPostHook, ForkRngPreHook
from ..errors import ScheduleValueError
from .base import Primitive, register_primitive

_ATTR = "_schedlang_forked_rng"


@register_primitive
class ForkRng(Primitive):
    """Give this module's random ops (dropout) a per-rank random stream, as tensor-parallel
    regions need, without disturbing the default stream the rest of the model uses.

    Example::

        sch["layers.0.attn.drop"].fork_rng()
    """

    # dropout differs by design after forking: Verify mirrors the forked stream on the original in training mode
    name = "fork_rng"

    @classmethod
    def validate(cls, sch):
        if hasattr(sch.mod, _ATTR):
            raise ScheduleValueError(f"{sch.path or '<root>'}: fork_rng was already applied here; fork the RNG of each module only once")
        return {}

    @classmethod
    def apply(cls, sch):
        module = sch.mod
        setattr(module, _ATTR, ForkedRNG(torch.initial_seed() + FORK_OFFSET + sch.rank))
        module.register_forward_pre_hook(ForkRngPreHook(_ATTR))
        module.register_forward_hook(ForkRngPostHook(_ATTR), always_call=True)
        return None

"""Float8 all-gather under FSDP2: every weight's float8 scale from one all-reduce after each step.

With ``float8(fsdp_float8_all_gather=True)`` and ``fully_shard``, FSDP2 all-gathers a float8 Linear's
weight already cast to float8 (half the bytes of bf16). The cast needs the weight's scale, which
depends on the amax of the *whole* weight, so each rank's shard alone cannot give it. Left to
itself, torchao all-reduces one amax per weight inside each all-gather: a small collective per
Linear per step. torchao's ``precompute_float8_dynamic_scale_for_fsdp`` computes every weight's
amax together, with one all-reduce, and stores the scales for the next all-gathers; the numbers are
the same. It has to run after every optimizer step (the weights changed), which
:func:`precompute_scales_after_step` arranges with an optimizer step hook; ``schedlang.build`` does
so for the optimizer it makes.

A stored scale belongs to the weights it was computed from: after the weights change in another
way (a checkpoint loaded, an initialization), :func:`clear_precomputed_scales` drops them, and the
next all-gathers compute their own until the next step stores new ones.
"""

from __future__ import annotations

import logging
import sys
from typing import List

import torch
from torch import nn

__all__ = ["float8_all_gather_linears", "precompute_float8_scales", "precompute_scales_after_step",
           "clear_precomputed_scales"]

logger = logging.getLogger("schedlang.distributed.float8_fsdp")


def float8_all_gather_linears(model: nn.Module) -> List[nn.Module]:
    """The float8 Linears of ``model`` whose weights FSDP2 all-gathers in float8 (none without torchao)."""
    if "torchao.float8" not in sys.modules:  # nothing can be a float8 Linear; importing torchao takes seconds
        return []
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    from torch.distributed.tensor import DTensor

    return [m for m in model.modules()
            if isinstance(m, Float8Linear) and isinstance(m.weight, DTensor)
            and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)]


def precompute_float8_scales(model: nn.Module) -> int:
    """Compute and store the float8 scale of every float8 all-gathered weight (one all-reduce; every rank of
    the data-parallel group must call it). Returns how many weights it covered."""
    count = len(float8_all_gather_linears(model))
    if count:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
    return count


def clear_precomputed_scales(model: nn.Module) -> int:
    """Drop the stored scales (the weights changed outside an optimizer step); returns how many."""
    linears = float8_all_gather_linears(model)
    for linear in linears:
        linear.weight._local_tensor._precomputed_scale = None
    return len(linears)


class _PrecomputeAfterStep:
    """Optimizer step post-hook: the scales of the weights the step just wrote."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, optimizer, args, kwargs):
        precompute_float8_scales(self.model)


def precompute_scales_after_step(model: nn.Module, optimizer: torch.optim.Optimizer):
    """After every ``optimizer.step()``, store the float8 scales of ``model``'s float8 all-gathered weights.

    Returns the hook's handle (``.remove()`` undoes it), or None when ``model`` has no such weights.

    Example::

        model, opt = schedlang.build(sch)          # float8(fsdp_float8_all_gather=True) + fully_shard
        schedlang.distributed.float8_fsdp.precompute_scales_after_step(model, opt)
    """
    linears = float8_all_gather_linears(model)
    if not linears:
        return None
    logger.info("float8 all-gather: the scales of %d weights are computed after each optimizer step", len(linears))
    return optimizer.register_step_post_hook(_PrecomputeAfterStep(model))

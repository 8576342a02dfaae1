"""A hint when every gradient of the scheduled model is the original's times one common factor.

A tensor-parallel schedule whose forward is right but whose gradients are all ``world`` times too large has
summed, over the ranks, a gradient that every rank already held whole: an ``all_gather`` in forward with
``tensor_parallel_output_grad=True`` (its backward reduce-scatters, which sums) feeding a consumer that is
replicated (a loss computed whole on every rank), or a ``bwd_post`` all-reduce applied twice. The factor then
reaches every parameter upstream of that point, which is every parameter when it is the LM head. A factor of
``1 / world`` is the converse: a gradient averaged over the ranks where it must be summed.

The element differences alone do not show that; :class:`GradientScales` collects, per compared gradient, the
factor that best maps the original's gradient onto the scheduled one (least squares) and how well it does,
and :meth:`GradientScales.hint` says so when one factor fits them all.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence

import torch

__all__ = ["GradientScales"]

#: a gradient is a scaled copy of the original's when the least-squares fit leaves at most this relative residual
#: (or the half-precision norm bound, if larger); the factors of all gradients must agree as closely
SCALED_COPY_RTOL = 0.01


@dataclasses.dataclass(frozen=True)
class _Scale:
    what: str
    factor: float
    residual: float  # ||actual - factor * expected|| / ||factor * expected||
    rtol: float
    failed: bool


def _plain(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "to_local", None)  # a DTensor: its local shard
    return (local() if callable(local) else t).detach().double().cpu()


class GradientScales:
    """The scale of each compared gradient against the original's, and whether it failed its comparison."""

    def __init__(self) -> None:
        self.scales: List[_Scale] = []
        self.failed = 0

    def add(self, what: str, actual: torch.Tensor, expected: torch.Tensor, norm_rtol: float, failed: bool) -> None:
        """Record one gradient comparison. Zero gradients (in either model) tell no factor and are left out,
        as are non-finite ones and shapes that differ (reported by the comparison itself)."""
        self.failed += int(failed)
        act, exp = _plain(actual), _plain(expected)
        if act.shape != exp.shape or not exp.is_floating_point():
            return
        if not bool(torch.isfinite(act).all()) or not bool(torch.isfinite(exp).all()):
            return
        expected_sq, actual_sq = float((exp * exp).sum()), float((act * act).sum())
        if expected_sq == 0.0 or actual_sq == 0.0:
            return
        factor = float((act * exp).sum()) / expected_sq
        if factor == 0.0:
            self.scales.append(_Scale(what, 0.0, math.inf, SCALED_COPY_RTOL, failed))
            return
        residual = float((act - factor * exp).norm()) / (abs(factor) * math.sqrt(expected_sq))
        self.scales.append(_Scale(what, factor, residual, max(SCALED_COPY_RTOL, norm_rtol), failed))

    def common_factor(self, mismatches: int) -> Optional[float]:
        """The one factor every gradient is scaled by, when it explains all ``mismatches`` of the check (no
        output differs) and is not 1; else None."""
        if mismatches == 0 or self.failed != mismatches or not any(s.failed for s in self.scales):
            return None
        if any(s.residual > s.rtol for s in self.scales):
            return None
        factors = sorted(s.factor for s in self.scales)
        middle = factors[len(factors) // 2]
        rtol = max(s.rtol for s in self.scales)
        if any(abs(f - middle) > rtol * abs(middle) for f in factors) or abs(middle - 1.0) <= rtol:
            return None
        return middle

    def hint(self, mismatches: int, world: int, plan: Sequence) -> Optional[str]:
        """The hint for the report (None if no common factor): the factor, what it is relative to the world
        size, the likely causes and the sync steps of ``plan`` (a schedule's :class:`~schedlang.plan.Plan`)
        that could be them."""
        factor = self.common_factor(mismatches)
        if factor is None:
            return None
        rtol = max(s.rtol for s in self.scales)
        text = (f"every gradient is {factor:.4g} times the original's ({len(self.scales)} nonzero gradients, one "
                f"common factor; the outputs agree)")
        averaging = world > 1 and abs(factor * world - 1.0) <= rtol
        steps = _gradient_sync_steps(plan, averaging)
        named = "; sync steps that could do it: " + ", ".join(steps) if steps else ""
        if world > 1 and abs(factor - world) <= rtol * world:
            return (f"{text}: the world size, {world}. A gradient every rank already held whole was summed over the "
                    f"ranks: an all_gather in forward with tensor_parallel_output_grad=True (the default; its "
                    f"backward reduce-scatters) whose output is consumed whole on every rank, as by a loss, needs "
                    f"tensor_parallel_output_grad=False; or a bwd_post all_reduce is applied twice{named}")
        if averaging:
            return (f"{text}: 1 / the world size, {world}. A gradient was averaged over the ranks where it must be "
                    f"summed (a bwd_post sync that divides by the world size){named}")
        return f"{text}: the backward scales the gradient somewhere{named}"


def _gradient_sync_steps(plan: Sequence, averaging: bool = False) -> List[str]:
    """The sync steps of ``plan`` whose backward could scale every gradient upstream, as ``#index sync at 'path'
    (arguments)``: forward all_gathers that reduce-scatter (sum) their gradient and bwd_post all_reduces or
    callables; with ``averaging``, only bwd_post syncs (an all_gather's backward never divides). A forward
    all_reduce's backward is the identity, and a gather with tensor_parallel_output_grad=False slices."""
    found = []
    for index, step in enumerate(plan):
        if step.primitive != "sync":
            continue
        op, mode = step.args.get("sync_op_or_fn"), step.args.get("mode")
        summing_gather = (op == "all_gather" and mode in ("fwd_pre", "fwd_post")
                          and step.args.get("tensor_parallel_output_grad", True) and not averaging)
        backward_sync = mode == "bwd_post" and (op == "all_reduce" or callable(op))
        if summing_gather or backward_sync:
            found.append(f"#{index} sync at '{step.path or '<root>'}' ({step.describe()})")
    return found

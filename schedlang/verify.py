"""``Verify``: check that a schedule computes what the original model computes.

Used as a context manager around the primitives to check::

    with schedlang.Verify(sch, example_inputs=[x]):
        sch["fc1"].shard("weight", axis=0)
        ...

On exit it builds two models from the same weights: the *reference* (a copy of the
original model) and the *scheduled* model (the whole plan replayed on another copy, so
every shard is cut from the same full tensor). When distributed, the weights and the inputs are first
broadcast from rank 0. Both run forward in eval mode (dropout off) on the same inputs,
then backward from the same random output gradients. It compares

* every output tensor,
* the gradient of every floating-point input,
* every parameter gradient: a parameter the plan left whole against the reference's,
  a shard against the matching slice of the reference's full gradient,

with per-dtype tolerances, and raises :class:`~schedlang.VerificationError` (an
``AssertionError``) on every rank if any rank found a difference, naming what differs, by
how much, and the steps applied inside the block.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .distributed import groups
from .distributed.agreement import RankFailureError, agreement, check_same_plan
from .distributed.sharding import shard_source
from .errors import ScheduleValueError, VerificationError
from .plan import Plan, apply_steps

__all__ = ["Verify", "VerifyReport", "DEFAULT_TOLERANCES"]

logger = logging.getLogger("schedlang.verify")

#: (rtol, atol) per dtype; atol is scaled by max(1, max |expected|) so large gradients are not held to tiny absolutes
DEFAULT_TOLERANCES: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclasses.dataclass
class VerifyReport:
    """What a verification compared and found."""

    compared: List[str] = dataclasses.field(default_factory=list)
    mismatches: List[str] = dataclasses.field(default_factory=list)
    not_compared: List[str] = dataclasses.field(default_factory=list)
    steps: List[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.mismatches

    def __str__(self) -> str:
        head = "passed" if self.passed else f"FAILED ({len(self.mismatches)} mismatches)"
        lines = [f"Verify {head}: compared {len(self.compared)} tensors (outputs, input and parameter gradients)"]
        lines += [f"  mismatch: {m}" for m in self.mismatches]
        if self.not_compared:
            lines.append(f"  not compared (no counterpart in the original model): {', '.join(self.not_compared)}")
        return "\n".join(lines)


def _flatten(value: Any, prefix: str, out: List[Tuple[str, torch.Tensor]]) -> None:
    if isinstance(value, torch.Tensor):
        out.append((prefix, value))
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", out)


def _outputs(value: Any) -> List[Tuple[str, torch.Tensor]]:
    out: List[Tuple[str, torch.Tensor]] = []
    _flatten(value, "output", out)
    return out


def _tolerance(dtype: torch.dtype, rtol: Optional[float], atol: Optional[float]) -> Tuple[float, float]:
    base_rtol, base_atol = DEFAULT_TOLERANCES.get(dtype, (1e-4, 1e-5))
    return (base_rtol if rtol is None else rtol), (base_atol if atol is None else atol)


def _compare(what: str, actual: torch.Tensor, expected: torch.Tensor, rtol, atol) -> Optional[str]:
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)} but the original gives {tuple(expected.shape)}"
    if not expected.is_floating_point():
        if not torch.equal(actual.cpu(), expected.cpu()):
            return f"{what}: values differ (integer tensor)"
        return None
    r, a = _tolerance(expected.dtype, rtol, atol)
    act, exp = actual.detach().double().cpu(), expected.detach().double().cpu()
    if torch.isnan(act).any() and not torch.isnan(exp).any():
        return f"{what}: contains NaN where the original has none"
    scale = max(1.0, float(exp.abs().max())) if exp.numel() else 1.0
    diff = (act - exp).abs()
    bad = diff > (a * scale + r * exp.abs())
    bad &= ~(torch.isnan(act) & torch.isnan(exp))
    if bad.any():
        worst = int(torch.argmax(torch.where(bad, diff, torch.zeros_like(diff))))
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape)) if diff.dim() else ()
        return (f"{what}: max abs diff {float(diff.max()):.3e} at index {index} (got {float(act.flatten()[worst]):.6g}, "
                f"expected {float(exp.flatten()[worst]):.6g}); {int(bad.sum())} of {bad.numel()} elements outside "
                f"rtol={r:g}, atol={a:g}x{scale:.3g}")
    return None


def _gradient_pairs(name: str, p: torch.Tensor, names: Dict[int, str], ref_params: Dict[str, torch.Tensor]):
    """``[(description, scheduled grad, expected grad)]`` for one scheduled parameter, or None if it has no
    counterpart in the original model.

    A parameter the plan left alone is the same object as before the replay; a shard
    remembers its source and slice; a parameter made by horizontal fusion remembers which
    part of it came from which original parameter.
    """
    if id(p) in names:
        return [(f"gradient of parameter '{name}'", p.grad, ref_params[names[id(p)]].grad)]
    found = shard_source(p)
    if found is not None and id(found[0]) in names:
        src, spec = found
        full = ref_params[names[id(src)]].grad
        what = (f"gradient of parameter '{name}' (shard {spec.rank}/{spec.world_size} along axis {spec.axis} of "
                f"'{names[id(src)]}')")
        return [(what, p.grad, None if full is None else spec.slice_of(full))]
    from .graph.passes.horizontal import fused_sources

    pieces = fused_sources(p)
    if pieces and all(id(src) in names for src, _ in pieces):
        return [(f"gradient of parameter '{name}' (the part that is '{names[id(src)]}')",
                 None if p.grad is None else part.take(p.grad), ref_params[names[id(src)]].grad)
                for src, part in pieces]
    return None


class Verify:
    """Context manager that checks the primitives applied inside it (forward and backward).

    Arguments:
        sch: the schedule (any view of it).
        example_inputs: positional inputs of the model (tensors or other values).
        example_kwargs: keyword inputs.
        rtol, atol: override the per-dtype tolerances (:data:`DEFAULT_TOLERANCES`).
        check_backward: compare input and parameter gradients too (default True).
        seed: seeds the random output gradients (identical on every rank).
        enable: set False to skip the check (e.g. in production runs).

    Example::

        with schedlang.Verify(sch, example_inputs=[torch.randn(8, 32)]):
            sch["fc2"].shard("weight", axis=1)
            sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    """

    def __init__(self, sch, example_inputs: Sequence[Any] = (), example_kwargs: Optional[Dict[str, Any]] = None,
                 rtol: Optional[float] = None, atol: Optional[float] = None, check_backward: bool = True,
                 seed: int = 0, enable: bool = True):
        if not isinstance(example_inputs, (list, tuple)):
            raise ScheduleValueError(f"Verify: example_inputs must be a list or tuple of inputs, got "
                                     f"{type(example_inputs).__name__}")
        self.sch = sch.root
        self.example_inputs = list(example_inputs)
        self.example_kwargs = dict(example_kwargs or {})
        self.rtol, self.atol = rtol, atol
        self.check_backward = check_backward
        self.seed = seed
        self.enable = enable
        self.start = 0
        self.report: Optional[VerifyReport] = None

    def __enter__(self) -> "Verify":
        self.start = len(self.sch.plan)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None and self.enable:
            self.run()
        return False

    # ------------------------------------------------------------------
    def _block_steps(self) -> List[str]:
        plan = self.sch.plan
        return [f"#{i} {plan[i].primitive} at '{plan[i].path or '<root>'}' ({plan[i].describe()})"
                for i in range(self.start, len(plan))]

    def _device(self) -> torch.device:
        for x in list(self.example_inputs) + list(self.example_kwargs.values()):
            if isinstance(x, torch.Tensor):
                return x.device
        return torch.device("cpu")

    def _inputs(self, device):
        def prep(x):
            if isinstance(x, torch.Tensor):
                x = x.detach().clone().to(device)
                if x.is_floating_point() and self.check_backward:
                    x.requires_grad_(True)
            return x

        return [prep(x) for x in self.example_inputs], {k: prep(v) for k, v in self.example_kwargs.items()}

    def _run_model(self, model: nn.Module, device):
        args, kwargs = self._inputs(device)
        out = _outputs(model(*args, **kwargs))
        if self.check_backward:
            gen = torch.Generator().manual_seed(self.seed)
            total = None
            for _, t in out:
                if t.is_floating_point() and t.requires_grad:
                    cot = torch.randn(t.shape, generator=gen, dtype=torch.float32, device="cpu").to(t.device, t.dtype)
                    term = (t * cot).sum()
                    total = term if total is None else total + term
            if total is not None:
                total.backward()
        grads = [(f"input[{i}] gradient", a.grad) for i, a in enumerate(args)
                 if isinstance(a, torch.Tensor) and a.grad is not None]
        grads += [(f"input '{k}' gradient", v.grad) for k, v in kwargs.items()
                  if isinstance(v, torch.Tensor) and v.grad is not None]
        return out, grads

    @staticmethod
    def _broadcast(x, src, group, device):
        if not isinstance(x, torch.Tensor):
            return x
        x = x.detach().clone().to(device)
        dist.broadcast(x, src=src, group=group)
        return x

    def run(self) -> VerifyReport:
        """Run the check now; returns the report or raises VerificationError."""
        state = self.sch._state
        group = state.group
        report = VerifyReport(steps=self._block_steps())
        original = state.original
        if any(t.is_meta for t in list(original.parameters()) + list(original.buffers())):
            raise ScheduleValueError("Verify needs a model with real weights; this one is on the meta device. Verify "
                                     "the schedule on a small real instance, then replay its plan on the meta model")
        device = self._device()
        reference = copy.deepcopy(original).to(device)
        check_same_plan(self.sch.plan, group, phase="verify: plan comparison")
        if groups.world_size(group) > 1:
            src = dist.get_global_rank(group, 0) if group is not None else 0
            with torch.no_grad():
                for t in list(reference.parameters()) + list(reference.buffers()):
                    dist.broadcast(t.data, src=src, group=group)
            # tensor parallelism needs the same inputs everywhere: use rank 0's
            self.example_inputs = [self._broadcast(x, src, group, device) for x in self.example_inputs]
            self.example_kwargs = {k: self._broadcast(v, src, group, device) for k, v in self.example_kwargs.items()}
        base = copy.deepcopy(reference)
        names = {id(p): n for n, p in base.named_parameters()}
        keep_alive = list(base.parameters())  # shard sources are weakly referenced
        from .schedule import Schedule, _RootState

        replayed = Schedule(_RootState(base, reference, group, state.mesh))
        with agreement(group, phase="verify: replaying the plan"):
            apply_steps(replayed, Plan(self.sch.plan.steps))
        scheduled = replayed._state.module
        reference.eval()
        scheduled.eval()
        failure: Optional[str] = None
        try:
            with agreement(group, phase="verify: running the original and the scheduled model"):
                ref_out, ref_grads = self._run_model(reference, device)
                out, grads = self._run_model(scheduled, device)
        except RankFailureError:  # only some ranks failed: every rank raises it, naming them
            raise
        except Exception as e:  # report it on every rank instead of leaving the others waiting
            failure = f"running the models raised {type(e).__name__}: {e}"
            ref_out = out = ref_grads = grads = []
        if failure is None:
            self._compare_all(report, ref_out, out, ref_grads, grads, reference, scheduled, names)
        else:
            report.mismatches.append(failure)
        del keep_alive
        self._finish(report, group)
        return report

    def _compare_all(self, report, ref_out, out, ref_grads, grads, reference, scheduled, names):
        if len(out) != len(ref_out):
            report.mismatches.append(f"the scheduled model returns {len(out)} tensors, the original {len(ref_out)}")
        for (name, expected), (_, actual) in zip(ref_out, out):
            report.compared.append(name)
            msg = _compare(name, actual, expected, self.rtol, self.atol)
            if msg:
                report.mismatches.append(msg)
        for (name, expected), (_, actual) in zip(ref_grads, grads):
            report.compared.append(name)
            msg = _compare(name, actual, expected, self.rtol, self.atol)
            if msg:
                report.mismatches.append(msg)
        if len(ref_grads) != len(grads):
            report.mismatches.append(f"{len(grads)} input gradients, the original has {len(ref_grads)}")
        if not self.check_backward:
            return
        ref_params = dict(reference.named_parameters())
        for name, p in scheduled.named_parameters():
            pairs = _gradient_pairs(name, p, names, ref_params)
            if pairs is None:
                report.not_compared.append(name)
                continue
            for what, got, expected in pairs:
                report.compared.append(what)
                if got is None and expected is None:
                    continue
                if got is None or expected is None:
                    present = "has no gradient" if got is None else "has a gradient"
                    other = "the original's has one" if got is None else "the original's has none"
                    report.mismatches.append(f"{what}: {present} but {other}")
                    continue
                msg = _compare(what, got, expected, self.rtol, self.atol)
                if msg:
                    report.mismatches.append(msg)

    def _finish(self, report: VerifyReport, group) -> None:
        self.report = report
        world = groups.world_size(group)
        rank = groups.rank(group)
        per_rank = [(rank, report.mismatches)]
        if world > 1:
            gathered: List[Any] = [None] * world
            dist.all_gather_object(gathered, (rank, report.mismatches), group=group)
            per_rank = gathered
        failing = [(r, m) for r, m in per_rank if m]
        if not failing:
            logger.info("verification passed: %d tensors compared", len(report.compared))
            return
        lines = ["the scheduled model does not match the original model"]
        for r, mismatches in failing:
            where = f" on rank {r}" if world > 1 else ""
            lines += [f"  {m}{where}" for m in mismatches[:10]]
            if len(mismatches) > 10:
                lines.append(f"  ... and {len(mismatches) - 10} more{where}")
        if report.steps:
            lines.append("steps applied inside this Verify block:")
            lines += [f"  {s}" for s in report.steps]
        else:
            lines.append("no steps were applied inside this Verify block; an earlier step broke it")
        raise VerificationError("\n".join(lines))

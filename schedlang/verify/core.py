"""The :class:`Verify` context manager: runs the original and the scheduled model, compares.

On exit it builds two models from the same weights: the *reference* (a copy of the original
model) and the *scheduled* model (the whole plan replayed on another copy, so every shard is
cut from the same full tensor). When distributed, the weights and the inputs are first
broadcast from rank 0. Then two passes, each forward and backward from the same random
output gradients:

1. **eval mode** (dropout off): outputs, input gradients and parameter gradients must equal
   the original's (a shard against its slice of the full gradient);
2. **training mode** (dropout on), both models seeded alike. Where the random streams can
   match (no forked stream, the same number of random draws) the same comparison is made;
   otherwise (a dropout on this rank's shard of an activation) every replicated tensor and
   gradient must agree across ranks.

In both, a module that activation checkpointing recomputes in backward must reproduce its
forward output. On a mismatch the report names the first module, in execution order, whose
output diverges, and a hint when it is an attention with a stale head count. A failed block
leaves no step in the plan (see :meth:`~schedlang.Schedule.atomic`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..argument_checks import check_int, check_number
from ..distributed import groups
from ..distributed.agreement import agreement, check_same_plan
from ..errors import ArgumentTypeError, ScheduleValueError, VerificationError
from ..plan import Plan, apply_steps
from . import ranks, slapo_arguments
from .compare import compare_tensors, nonfinite_summary, reduction_size_of, tolerance_for
from .counterparts import CounterpartFinder
from .expert_split import ExpertSplit
from .input_agreement import check_inputs_agree
from .locate import ModuleRecorder, attention_hint, first_divergence, flatten_outputs, split_input_hint
from .rng import fresh_forked_streams, rng_preserved, rng_state
from .split_outputs import SplitOutputs, sequence_split, split_heads, sum_over_sequence_split
from .uniform_factor import GradientScales

__all__ = ["Verify", "VerifyReport", "ExampleInputError", "VerifyWarning"]

logger = logging.getLogger("schedlang.verify")

class ExampleInputError(ScheduleValueError):
    """The example inputs cannot check a schedule: the original model fails on them, or gives
    non-finite outputs or gradients."""


class VerifyWarning(UserWarning):
    """Something Verify could not compare (a tensor with no counterpart in the original model)."""


@dataclasses.dataclass
class VerifyReport:
    """What a verification compared and found."""

    compared: List[str] = dataclasses.field(default_factory=list)
    mismatches: List[str] = dataclasses.field(default_factory=list)
    not_compared: List[str] = dataclasses.field(default_factory=list)
    warnings: List[str] = dataclasses.field(default_factory=list)
    notes: List[str] = dataclasses.field(default_factory=list)
    localization: List[str] = dataclasses.field(default_factory=list)
    steps: List[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.mismatches

    def __str__(self) -> str:
        head = "passed" if self.passed else f"FAILED ({len(self.mismatches)} mismatches)"
        lines = [f"Verify {head}: compared {len(self.compared)} tensors (outputs, input and parameter gradients, "
                 f"eval and training mode)"]
        lines += [f"  mismatch: {m}" for m in self.mismatches]
        lines += [f"  where: {m}" for m in self.localization]
        if self.not_compared:
            lines.append(f"  not compared (no counterpart in the original model): {', '.join(self.not_compared)}")
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclasses.dataclass
class _Run:
    """The results of one forward and backward pass of one model."""

    outputs: List[Tuple[str, torch.Tensor]]
    input_grads: List[Tuple[str, torch.Tensor]]
    rng_after_forward: List[Tuple[str, torch.Tensor]]


def _keyword_inputs(example_kwargs) -> Dict[str, Any]:
    """``example_kwargs`` as a dict of keyword inputs (None: none), or a ScheduleValueError saying what it must be."""
    try:
        kwargs = dict(example_kwargs or {})
    except (TypeError, ValueError):
        kwargs = None
    if kwargs is None or not all(isinstance(key, str) for key in kwargs):
        raise ScheduleValueError(f"Verify: example_kwargs must be a dict of keyword inputs {{name: value}} or None, "
                                 f"got {type(example_kwargs).__name__}")
    return kwargs


class Verify:
    """Context manager that checks the primitives applied inside it (forward and backward, in eval and
    training mode).

    Arguments:
        sch: the schedule (any view of it).
        example_inputs: positional inputs of the model (tensors or other values).
        example_kwargs: keyword inputs.
        rtol, atol: override the per-dtype elementwise tolerances
            (:data:`~schedlang.verify.DEFAULT_TOLERANCES`; an override also turns off the
            half-precision outlier allowance).
        check_backward: compare input and parameter gradients too (default True).
        check_training: run the training-mode pass too (dropout on; default True). A traced graph
            that depends on the mode beyond the constants of its calls (a branch on ``self.training``
            that adds or removes operations) runs only in the mode it was traced in: the other mode's pass is then skipped with a
            :class:`VerifyWarning` naming it, and a schedule left with no mode to compare is refused.
        seed: seeds the random output gradients and the training pass (identical on every rank).
        reduction_size: the longest reduction behind outputs and gradients, which widens the
            half-precision norm bound (default: estimated from the weights and inputs).
        enable: set False to skip the check (e.g. in production runs).

    Outputs the schedule leaves split on purpose (the logits of a vocabulary-parallel LM head, the
    default of ``shard_model``) are compared as this rank's slice of the original's, as the head's
    record says (the report notes it). Every rank must pass example inputs of the same shapes and
    dtypes (rank 0's values are used on all); when they differ, every rank raises
    :class:`~schedlang.verify.ExampleInputMismatchError` naming the ranks and shapes before any
    collective runs.

    Raises :class:`~schedlang.VerificationError` (an ``AssertionError``) on every rank if any rank
    found a difference, and :class:`ExampleInputError` if the original model itself fails on the
    example inputs. Either way no step of the block stays in the plan.

    Example::

        with schedlang.Verify(sch, example_inputs=[torch.randn(8, 32)]):
            sch["fc2"].shard("weight", axis=1)
            sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    """

    def __init__(self, sch, example_inputs: Sequence[Any] = (), example_kwargs: Optional[Dict[str, Any]] = None,
                 rtol: Optional[float] = None, atol: Optional[float] = None, check_backward: bool = True,
                 seed: int = 0, enable: bool = True, check_training: bool = True,
                 reduction_size: Optional[int] = None, device: Any = None, eval_mode: Optional[bool] = None):
        from ..schedule import Schedule

        # every argument is checked here, before the block runs: a bad one found on exit would undo the
        # block's steps and read as a failed check (a negative rtol as a mismatch, a bad seed as bad inputs)
        if not isinstance(sch, Schedule):
            raise ArgumentTypeError(f"Verify: sch must be a schedlang.Schedule (from schedlang.create_schedule(model)),"
                                    f" got {type(sch).__name__}")
        # Slapo's forms (one tensor, device=, eval_mode=, a meta model): see verify/slapo_arguments.py
        example_inputs = slapo_arguments.example_input_list(example_inputs)
        self.device = slapo_arguments.verify_device(device)
        check_training = slapo_arguments.training_check(eval_mode, check_training)
        self.example_kwargs = _keyword_inputs(example_kwargs)
        for name, tolerance in (("rtol", rtol), ("atol", atol)):
            if tolerance is not None:
                check_number("Verify", name, tolerance, minimum=0)
        check_int("Verify", "seed", seed)
        if reduction_size is not None:
            check_int("Verify", "reduction_size", reduction_size, minimum=1)
        self.sch = sch.root
        self.example_inputs = list(example_inputs)
        self.rtol, self.atol = rtol, atol
        self.check_backward = check_backward
        self.check_training = check_training
        self.seed = seed
        self.enable = enable
        self.reduction_size = reduction_size
        self.start = 0
        self.report: Optional[VerifyReport] = None
        self._atomic = None

    def __enter__(self) -> "Verify":
        self.start = len(self.sch.plan)
        self._atomic = self.sch.atomic()
        self._atomic.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        atomic, self._atomic = self._atomic, None
        if exc_type is not None:
            return bool(atomic.__exit__(exc_type, exc, tb))  # undoes the block, re-raises
        if self.enable:
            try:
                self.run()
            except BaseException as error:
                atomic.__exit__(type(error), error, error.__traceback__)  # undoes the block
                raise
        atomic.__exit__(None, None, None)
        return False

    # ------------------------------------------------------------------ running the models
    def _block_steps(self) -> List[str]:
        plan = self.sch.plan
        return [f"#{i} {plan[i].primitive} at '{plan[i].path or '<root>'}' ({plan[i].describe()})"
                for i in range(self.start, len(plan))]

    def _device(self) -> torch.device:
        if self.device is not None:
            return self.device
        tensors = [x for x in list(self.example_inputs) + list(self.example_kwargs.values())
                   if isinstance(x, torch.Tensor)]
        # an accelerator named by an input, else the model's own (Slapo's scripts pass CPU inputs to a CUDA model)
        for device in [t.device for t in tensors] + slapo_arguments.model_devices(self.sch._state.original):
            if device.type not in ("cpu", "meta"):
                return device
        return tensors[0].device if tensors else torch.device("cpu")

    def _prepare(self, args, kwargs, device):
        def prep(x):
            if isinstance(x, torch.Tensor):
                x = x.detach().clone().to(device)
                if x.is_floating_point() and self.check_backward:
                    x.requires_grad_(True)
            return x

        return [prep(x) for x in args], {k: prep(v) for k, v in kwargs.items()}

    def _run_model(self, model: nn.Module, args, kwargs, device, recorder: Optional[ModuleRecorder] = None,
                   split: Optional[SplitOutputs] = None) -> _Run:
        args, kwargs = self._prepare(args, kwargs, device)
        out: List[Tuple[str, torch.Tensor]] = []
        flatten_outputs(model(*args, **kwargs), "output", out)
        rng = rng_state(device, model)
        if self.check_backward:
            gen = torch.Generator().manual_seed(self.seed)
            total = None
            for name, t in out:
                if t.is_floating_point() and t.requires_grad:
                    # a split output (vocabulary-parallel logits) gets its slice of the original's output gradient
                    head = split.head_for(name, t.shape) if split is not None else None
                    shape = split.full_shape(name, t.shape) if head is not None else t.shape
                    cot = torch.randn(shape, generator=gen, dtype=torch.float32, device="cpu")
                    cot = (head.take(cot) if head is not None else cot).to(t.device, t.dtype)
                    term = (t * cot).sum()
                    total = term if total is None else total + term
            if total is not None:
                if recorder is not None:
                    recorder.recomputing = True
                try:
                    total.backward()
                finally:
                    if recorder is not None:
                        recorder.recomputing = False
                sum_over_sequence_split(model, [a for a in list(args) + list(kwargs.values())
                                                if isinstance(a, torch.Tensor)])
        grads = [(f"input[{i}] gradient", a.grad) for i, a in enumerate(args)
                 if isinstance(a, torch.Tensor) and a.grad is not None]
        grads += [(f"input '{k}' gradient", v.grad) for k, v in kwargs.items()
                  if isinstance(v, torch.Tensor) and v.grad is not None]
        return _Run([(n, t.detach()) for n, t in out], grads, rng)

    def _run_reference(self, reference, args, kwargs, device, mode: str) -> Tuple[_Run, ModuleRecorder]:
        with ModuleRecorder(reference) as recorder:
            try:
                run = self._run_model(reference, args, kwargs, device)
            except Exception as e:
                raise ExampleInputError(
                    f"Verify: the original model itself fails on the example inputs ({mode} mode): "
                    f"{type(e).__name__}: {e}; pass inputs the unscheduled model accepts") from e
        bad = [f"{name} ({summary})" for name, t in run.outputs + run.input_grads
               if (summary := nonfinite_summary(t)) is not None]
        bad += [f"gradient of parameter '{n}' ({summary})" for n, p in reference.named_parameters()
                if p.grad is not None and (summary := nonfinite_summary(p.grad)) is not None]
        if bad:
            raise ExampleInputError(
                f"Verify: the original model gives non-finite values on the example inputs ({mode} mode): "
                f"{'; '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; nothing can be compared against them. Use "
                f"smaller inputs or weights, or a wider dtype")
        return run, recorder

    # ------------------------------------------------------------------ the check
    def run(self) -> VerifyReport:
        """Run the check now; returns the report or raises VerificationError."""
        state = self.sch._state
        group = state.group
        report = VerifyReport(steps=self._block_steps())
        original = state.original
        device = self._device()
        # ranks agree before and after each phase with collectives inside it: a rank that fails makes
        # every rank raise within seconds, naming it, instead of leaving the others blocked
        check_same_plan(self.sch.plan, group, phase="verify: plan comparison")
        # before the broadcasts: tensors of different sizes on different ranks would abort the process in gloo
        check_inputs_agree(self.example_inputs, self.example_kwargs, original, group)
        with rng_preserved(device):
            if slapo_arguments.has_meta_tensors(original):  # Slapo's way: verify on real weights made for it
                reference = slapo_arguments.materialized_copy(original, device, self.seed)
            else:
                reference = copy.deepcopy(original).to(device)
            args, kwargs = list(self.example_inputs), dict(self.example_kwargs)
            if groups.world_size(group) > 1:
                # tensor parallelism needs the same weights and inputs everywhere: use rank 0's
                ranks.broadcast_reference(reference, group)
                args = ranks.broadcast_inputs(args, group, device)
                kwargs = dict(zip(kwargs, ranks.broadcast_inputs(list(kwargs.values()), group, device)))
            base = copy.deepcopy(reference)
            base_params = {id(p): n for n, p in base.named_parameters()}
            base_buffers = {id(b): n for n, b in base.named_buffers()}
            initial_buffers = {n: b.detach().clone() for n, b in reference.named_buffers()}
            keep_alive = list(base.parameters()) + list(base.buffers())  # shard sources are weakly referenced
            from ..schedule import Schedule, _RootState

            replayed = Schedule(_RootState(base, reference, group, state.mesh))
            with agreement(group, phase="verify: replaying the plan"):
                apply_steps(replayed, Plan(self.sch.plan.steps))
            scheduled = replayed._state.module
            experts = ExpertSplit(scheduled)  # expert parallelism: each rank its own tokens, where it can
            args, kwargs = experts.own_tokens(args, kwargs)
            report.notes += [experts.note()] if experts.spread else []
            size = self.reduction_size or reduction_size_of(reference, list(args) + list(kwargs.values()))
            from ..primitives.float8 import is_float8

            float8 = any(is_float8(m) for m in scheduled.modules())
            if float8:
                report.notes.append("float8 Linears: tensors compared by their whole-tensor relative error (up to "
                                    "0.3), not element by element")
            tol_for = functools.partial(tolerance_for, rtol=self.rtol, atol=self.atol, reduction_size=size,
                                        float8=float8)
            pass_ = _Pass(self, report, reference, scheduled, base_params, tol_for, group, device, args, kwargs,
                          experts)
            only = _mode_fixed_graphs(scheduled)  # graphs with a branch on the mode run in their traced mode alone
            with agreement(group, phase="verify: running the original and the scheduled model"):
                if only["training"] and only["eval"]:
                    raise VerificationError(
                        f"Verify: the scheduled model runs in neither mode: {_paths(only['training'])} only in "
                        f"training mode and {_paths(only['eval'])} only in eval mode (each was traced in that mode, "
                        "and its graph depends on it); trace them all in the mode the model will run in")
                if only["training"]:
                    if not self.check_training:
                        raise VerificationError(
                            f"Verify: nothing to compare: {_paths(only['training'])} run only in training mode "
                            "(traced in it, with a branch on self.training), and check_training=False "
                            "skips that mode; pass check_training=True, or trace them in eval mode")
                    report.warnings.append(
                        f"eval mode not checked: {_paths(only['training'])} were traced in training mode and depend on "
                        "it (a branch on self.training), so they run only in training mode")
                    pass_.training_mode([])
                else:
                    replicated_paths = pass_.eval_mode()
                    if self.check_training and only["eval"]:
                        report.warnings.append(
                            f"training mode not checked: {_paths(only['eval'])} were traced in eval mode and depend on "
                            "it (a branch on self.training), so they run only in eval mode")
                    elif self.check_training:
                        # decided together, so that every rank takes the same cross-rank steps
                        if ranks.all_ranks_agree(replicated_paths is not None and report.passed, group):
                            pass_.training_mode(replicated_paths)
                        else:
                            report.notes.append("training mode not checked: eval mode already differs")
                pass_.compare_buffers(base_buffers, initial_buffers)
            hint = pass_.scales.hint(len(report.mismatches), groups.world_size(group), self.sch.plan)
            if hint:
                report.localization.append(f"hint: {hint}")
            del keep_alive
        self._finish(report, group)
        return report

    def _finish(self, report: VerifyReport, group) -> None:
        self.report = report
        for text in report.warnings:
            logger.warning("Verify: %s", text)
            warnings.warn(f"Verify: {text}", VerifyWarning, stacklevel=3)
        world = groups.world_size(group)
        per_rank = ranks.gather_mismatches(report.mismatches + [f"where: {w}" for w in report.localization], group)
        failing = [(r, m) for r, m in per_rank if any(not x.startswith("where: ") for x in m)]
        if not failing:
            logger.info("verification passed: %d tensors compared", len(report.compared))
            return
        lines = ["the scheduled model does not match the original model"]
        for r, found in failing:
            where = f" on rank {r}" if world > 1 else ""
            mismatches = [m for m in found if not m.startswith("where: ")]
            lines += [f"  {m}{where}" for m in mismatches[:10]]
            if len(mismatches) > 10:
                lines.append(f"  ... and {len(mismatches) - 10} more{where}")
        seen = set()
        for r, found in failing:
            for m in found:
                if m.startswith("where: ") and m not in seen:
                    seen.add(m)
                    lines.append(f"  {m[len('where: '):]}{f' (rank {r})' if world > 1 else ''}")
        if report.steps:
            lines.append("steps applied inside this Verify block:")
            lines += [f"  {s}" for s in report.steps]
            lines.append("(the block is undone: the plan is as it was before it)")
        else:
            lines.append("no steps were applied inside this Verify block; an earlier step broke it")
        raise VerificationError("\n".join(lines))


def _mode_fixed_graphs(model: nn.Module) -> Dict[str, List[str]]:
    """The traced graphs of ``model`` that run in one training mode only, by that mode ("training" / "eval"), as
    the paths their guards name (see :mod:`schedlang.graph.tracer.training_mode`)."""
    from ..graph.tracer.training_mode import TrainingModeGuard

    found: Dict[str, List[str]] = {"training": [], "eval": []}
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, TrainingModeGuard):
                found["training" if hook.traced_training else "eval"].append(hook.where)
    return found


def _paths(paths: List[str]) -> str:
    shown = ", ".join(repr(p) for p in paths[:4])
    return shown + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")


class _Pass:
    """The comparisons of one verification, shared by the eval and the training pass."""

    def __init__(self, verify: Verify, report: VerifyReport, reference: nn.Module, scheduled: nn.Module,
                 base_params: Dict[int, str], tol_for, group, device, args, kwargs, experts: ExpertSplit):
        self.v, self.report = verify, report
        self.reference, self.scheduled = reference, scheduled
        self.base_params = base_params
        self.tol_for = tol_for
        self.group, self.device = group, device
        self.args, self.kwargs = args, kwargs
        self.heads = split_heads(scheduled)  # outputs the schedule leaves split: the vocabulary-parallel logits
        self.split: Optional[SplitOutputs] = None
        self.scales = GradientScales()  # eval mode's gradients against the original's: one common factor?
        self.experts = experts
        self.group_summed: Dict[str, Optional[torch.Tensor]] = {}  # the original's expert gradients, summed over ep

    # -------------------------------------------------------------- helpers
    def _compare(self, what: str, actual, expected, gradient: bool = False) -> None:
        self.report.compared.append(what)
        msg = compare_tensors(what, actual, expected, self.tol_for(expected.dtype))
        if msg:
            self.report.mismatches.append(msg)
        if gradient:
            self.scales.add(what, actual, expected, self.tol_for(expected.dtype).norm_rtol, msg is not None)

    def _run_scheduled(self, mode: str) -> Tuple[Optional[_Run], ModuleRecorder]:
        with ModuleRecorder(self.scheduled) as recorder:
            try:
                return self.v._run_model(self.scheduled, self.args, self.kwargs, self.device, recorder,
                                         self.split), recorder
            except Exception as e:  # report it on every rank instead of leaving the others waiting
                self.report.mismatches.append(f"running the scheduled model ({mode} mode) raised "
                                              f"{type(e).__name__}: {e}")
                return None, recorder

    def _zero_grads(self) -> None:
        self.reference.zero_grad(set_to_none=True)
        self.scheduled.zero_grad(set_to_none=True)

    def _compare_runs(self, prefix: str, expected: _Run, actual: _Run, warn: bool) -> None:
        report = self.report
        if len(actual.outputs) != len(expected.outputs):
            report.mismatches.append(f"{prefix}the scheduled model returns {len(actual.outputs)} tensors, the "
                                     f"original {len(expected.outputs)}")
        for (name, exp), (_, act) in zip(expected.outputs, actual.outputs):
            head = self.split.head_for(name, act.shape) if self.split is not None else None
            if head is not None:
                note = head.note(name)
                if note not in report.notes:
                    report.notes.append(note)
                exp = head.take(exp)
            self._compare(prefix + name, act, exp)
        if len(expected.input_grads) != len(actual.input_grads):
            report.mismatches.append(f"{prefix}{len(actual.input_grads)} input gradients, the original has "
                                     f"{len(expected.input_grads)}")
        for (name, exp), (_, act) in zip(expected.input_grads, actual.input_grads):
            self._compare(prefix + name, act, exp, gradient=not prefix)
        self._compare_parameters(prefix, warn)

    def _compare_parameters(self, prefix: str, warn: bool) -> None:
        report = self.report
        ref_params = dict(self.reference.named_parameters())
        finder = CounterpartFinder("parameter", self.base_params, ref_params, experts=self.experts)
        for name, p in self.scheduled.named_parameters():
            parts = finder.find(name, p)
            if parts is None:
                if warn:
                    report.not_compared.append(name)
                    report.warnings.append(f"parameter '{name}' {tuple(p.shape)} of the scheduled model has no "
                                           f"counterpart in the original model (not the same tensor, a shard, a "
                                           f"fused part, nor equal in value to exactly one original parameter): "
                                           f"its gradient was not compared")
                continue
            for part in parts:
                ref = ref_params[part.reference_name]
                if p.requires_grad != ref.requires_grad:
                    state = "trainable" if p.requires_grad else "frozen"
                    other = "frozen" if p.requires_grad else "trainable"
                    report.mismatches.append(f"{prefix}{part.description} is {state} but the original's is {other}")
                    continue
                if not p.requires_grad:
                    self._compare(f"{prefix}value of frozen {part.description}", part.take_local(p.detach()),
                                  part.take_reference(ref.detach()))
                    continue
                if not self.v.check_backward:
                    continue
                what = f"{prefix}gradient of {part.description}"
                got = None if p.grad is None else part.take_local(p.grad)
                ref_grad = self.group_summed.get(part.reference_name) if part.summed_over_group else ref.grad
                expected = None if ref_grad is None else part.take_reference(ref_grad)
                report.compared.append(what)
                if got is None and expected is None:
                    continue
                if got is None or expected is None:
                    present = "has no gradient" if got is None else "has a gradient"
                    other = "the original's has one" if got is None else "the original's has none"
                    report.mismatches.append(f"{what}: {present} but {other}")
                    continue
                msg = compare_tensors(what, got, expected, self.tol_for(expected.dtype))
                if msg:
                    report.mismatches.append(msg)
                if not prefix:
                    self.scales.add(what, got, expected, self.tol_for(expected.dtype).norm_rtol, msg is not None)
        if warn:
            for name in finder.unclaimed():
                report.warnings.append(f"parameter '{name}' of the original model has no counterpart in the scheduled "
                                       f"model: its gradient was not compared")

    def _localize(self, prefix: str, scheduled_rec: ModuleRecorder, reference_rec: ModuleRecorder) -> None:
        found = first_divergence(scheduled_rec, reference_rec, self.tol_for)
        if found is None:
            where = ("every module output that can be compared agrees with the original's; the difference arises in "
                     "backward" if self.v.check_backward else
                     "no module output with the original's shape diverges; the difference is in a split activation")
            self.report.localization.append(f"{prefix}{where}")
            path = None
        else:
            ours, theirs = found["shapes"]
            self.report.localization.append(
                f"{prefix}first diverging module (in execution order): '{found['path']}' ({found['type']}), output "
                f"shapes {ours} here and {theirs} in the original; {found['message']}")
            path = found["path"]
        # the diverging module's own attention first, else any attention of the model
        hint = attention_hint(self.scheduled, self.reference, path)
        if hint is None and found is not None:
            hint = split_input_hint(found)
        if hint:
            self.report.localization.append(f"hint: {hint}")

    def _replicated_module_outputs(self, scheduled_rec: ModuleRecorder, reference_rec: ModuleRecorder) -> List[str]:
        """Paths of modules called once whose output has the original's shape and value: replicated activations.
        A module called several times is left out: its calls may come in another order on another rank (a model
        that computes one rotary embedding per kind of layer iterates over a set, whose order follows each
        process's string hashing)."""
        paths = []
        for path, calls in scheduled_rec.forward.items():
            ref_calls = reference_rec.forward.get(path)
            if len(calls) != 1 or not ref_calls or len(calls[0]) != len(ref_calls[0]):
                continue
            if all(a.shape == b.shape and compare_tensors("", a, b, self.tol_for(b.dtype)) is None
                   for a, b in zip(calls[0], ref_calls[0])):
                paths.append(path)
        return paths

    # -------------------------------------------------------------- the passes
    def eval_mode(self) -> Optional[List[str]]:
        """Compare in eval mode; returns the module paths whose outputs are replicated activations (None if
        the scheduled model failed to run)."""
        self.reference.eval()
        self.scheduled.eval()
        expected, ref_rec = self.v._run_reference(self.reference, self.args, self.kwargs, self.device, "eval")
        self.group_summed = self.experts.summed_gradients(self.reference) if self.v.check_backward else {}
        self.split = SplitOutputs(self.heads, {n: tuple(t.shape) for n, t in expected.outputs},
                                  sequence_split(self.scheduled))
        actual, rec = self._run_scheduled("eval")
        if actual is None:
            return None
        before = len(self.report.mismatches)
        self._compare_runs("", expected, actual, warn=True)
        self.report.mismatches += rec.recompute_mismatches(self.tol_for)
        if len(self.report.mismatches) > before:
            self._localize("", rec, ref_rec)
        return self._replicated_module_outputs(rec, ref_rec)

    def training_mode(self, replicated_paths: Optional[List[str]]) -> None:
        """Compare in training mode: with the original where the random streams match; across ranks too."""
        self._zero_grads()
        self.reference.train()
        self.scheduled.train()
        forked = fresh_forked_streams(self.scheduled, self.reference)
        torch.manual_seed(self.v.seed)
        expected, ref_rec = self.v._run_reference(self.reference, self.args, self.kwargs, self.device, "training")
        self.group_summed = self.experts.summed_gradients(self.reference) if self.v.check_backward else {}
        self.split = SplitOutputs(self.heads, {n: tuple(t.shape) for n, t in expected.outputs},
                                  sequence_split(self.scheduled))
        torch.manual_seed(self.v.seed)
        actual, rec = self._run_scheduled("training")
        same_draws = actual is not None and len(actual.rng_after_forward) == len(expected.rng_after_forward) and all(
            na == nb and a.shape == b.shape and torch.equal(a, b)
            for (na, a), (nb, b) in zip(actual.rng_after_forward, expected.rng_after_forward))
        streams_match = ranks.all_ranks_agree(same_draws, self.group)
        prefix = "training mode: "
        before = len(self.report.mismatches)
        if streams_match:
            self.report.notes.append(f"training mode compared with the original under seed {self.v.seed}"
                                     + (f" (forked streams at {', '.join(forked)} mirrored)" if forked else ""))
            self._compare_runs(prefix, expected, actual, warn=False)
            why = "replicated tensors"
        else:
            # the draws differ in count or values; which op drew them is not known here, so name the usual causes
            why = ("the scheduled model draws other random numbers than the original (for example a dropout inside "
                   "a fused kernel, which draws its own mask, or one on a split activation"
                   + (f"; forked streams at {', '.join(forked)})" if forked else ")"))
        compared_with_reference = len(self.report.mismatches)
        self._cross_rank(prefix, why, streams_match, expected, actual, rec, replicated_paths)
        if actual is not None:
            self.report.mismatches += [prefix + m for m in rec.recompute_mismatches(self.tol_for)]
            # a divergence from the original only means something where the random streams match
            if streams_match and compared_with_reference > before:
                self._localize(prefix, rec, ref_rec)

    def _cross_rank(self, prefix: str, why: str, streams_match: bool, expected: _Run, actual: Optional[_Run],
                    rec: ModuleRecorder, replicated_paths: Optional[List[str]]) -> None:
        """Every replicated tensor of the training pass must agree across ranks (a cross-rank step:
        every rank calls it, even one whose run failed)."""
        if groups.world_size(self.group) <= 1 or self.experts.distinct_inputs:  # no tensor replicated: nothing to do
            if actual is not None and not streams_match:
                self.report.warnings.append(f"training mode: {why}; training outputs and gradients could not be "
                                            f"compared with the original's (only recomputed regions were checked)")
            return
        tensors: Dict[str, torch.Tensor] = {}
        if actual is not None:
            reference_shapes = {n: t.shape for n, t in expected.outputs + expected.input_grads}
            for name, t in actual.outputs + actual.input_grads:
                if reference_shapes.get(name) == t.shape:
                    tensors[name] = t
            ref_params = dict(self.reference.named_parameters())
            finder = CounterpartFinder("parameter", self.base_params, ref_params)
            for name, p in self.scheduled.named_parameters():
                parts = finder.find(name, p)
                if parts and len(parts) == 1 and parts[0].whole and p.grad is not None:
                    tensors[f"gradient of parameter '{name}'"] = p.grad
            for path in replicated_paths or ():
                calls = rec.forward.get(path)
                if calls:
                    for i, t in enumerate(calls[0]):
                        tensors[f"output of module '{path}'" + (f"[{i}]" if len(calls[0]) > 1 else "")] = t
        messages, compared = ranks.replicated_disagreements(tensors, self.group, self.tol_for, prefix)
        if streams_match:
            self.report.notes.append(f"training mode: {compared} replicated tensors agree across ranks")
        else:
            self.report.notes.append(f"training mode: {why}; checked that {compared} replicated tensors agree across "
                                     f"ranks instead of comparing with the original")
        self.report.compared += [prefix + n + " (across ranks)" for n in tensors]
        self.report.mismatches += messages

    def compare_buffers(self, base_buffers: Dict[int, str], initial: Dict[str, torch.Tensor]) -> None:
        """Buffers (running statistics, caches) must equal the original's after both passes."""
        ref_buffers = dict(self.reference.named_buffers())
        finder = CounterpartFinder("buffer", base_buffers, ref_buffers, initial)
        for name, b in self.scheduled.named_buffers():
            parts = finder.find(name, b)
            if parts is None:
                self.report.not_compared.append(name)
                self.report.warnings.append(f"buffer '{name}' {tuple(b.shape)} of the scheduled model has no "
                                            f"counterpart in the original model: its value was not compared")
                continue
            for part in parts:
                self._compare(f"value of {part.description}", part.take_local(b.detach()),
                              part.take_reference(ref_buffers[part.reference_name].detach()))
        for name in finder.unclaimed():
            self.report.warnings.append(f"buffer '{name}' of the original model has no counterpart in the scheduled "
                                        f"model: its value was not compared")

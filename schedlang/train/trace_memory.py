"""``--dry-run --trace-memory``: the peak memory of one rank measured by running it, beside the formula's.

The cost model (:mod:`schedlang.autotune.step_cost`) adds up a step's tensors by a formula. This module runs the
step instead, without a device and without allocating anything: one rank of the real job (rank 0: the first
pipeline stage, which keeps the most microbatches in flight under 1F1B, and otherwise a rank like every other)
joins torch's fake process group of the job's world size, where every collective returns at once, and the
trainer's own :class:`~schedlang.train.run._Run` builds its model (the same schedule: tensor and sequence
parallelism, checkpointing, pipeline stages, FSDP2 / HSDP / DDP, the optimizer) with every tensor a fake one
(``FakeTensorMode``: shapes, dtypes and storage sizes, no data). Two training steps run through the trainer's
``train_step`` under torch's memory tracker (``FSDPMemTracker`` where FSDP2 wraps a module called once per step,
``MemTracker`` otherwise); the first creates the optimizer's state, which every later step of a run finds in
place, so the peak over both is the run's.

What it cannot see: the tensors run on fake CPU tensors (a CPU-only torch cannot run autograd on fake CUDA ones),
so a kernel chosen by device could differ (CPU's SDPA keeps the log-sum-exp as flash attention does); the layers
run eager (``torch.compile`` and ``optimize_model``'s Triton kernels do not run on fake tensors): the formula it is
compared with is that of the same eager layout; schedlang's fused AdamW is traced as ``torch.optim.AdamW`` (the
same state, a per-parameter loop); the caching allocator's rounding and fragmentation are not modelled. The
formula's allowance for what is no tensor (a CUDA rank's workspace) is added to the traced tensors alike.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import logging
import time
import warnings
from typing import Dict, Optional

import torch

from ..autotune.training_cost import GIB, StepEstimate, estimate_step
from .flags import TrainError

logger = logging.getLogger("schedlang.train")


class TraceMemoryError(TrainError):
    """``--trace-memory`` cannot trace this run (a missing piece of torch, or a combination it does not run)."""


@dataclasses.dataclass
class TracedPeak:
    """The traced step of one rank: its peak (tensors plus the formula's allowance for what is no tensor), the
    formula's peak for the same (eager) layout, and what was traced."""

    rank: int
    tensor_bytes: int
    allowance_bytes: float
    formula: StepEstimate
    by_kind: Dict[str, int]
    notes: list
    seconds: float

    @property
    def peak_bytes(self) -> float:
        return self.tensor_bytes + self.allowance_bytes

    @property
    def formula_bytes(self) -> float:
        return self.formula.total_bytes

    @property
    def gap(self) -> float:
        """The formula's error relative to the trace would read the other way; this is the trace against the
        formula: -0.04 is a trace 4% below the formula."""
        return self.peak_bytes / self.formula_bytes - 1.0

    def line(self) -> str:
        text = (f"peak per rank: formula {self.formula_bytes / GIB:.3g} GiB, traced {self.peak_bytes / GIB:.3g} GiB "
                f"({100 * self.gap:+.1f}%)")
        where = f"rank {self.rank} traced on fake tensors in {self.seconds:.0f} s"
        return f"{text}; {where}" + (f"; {'; '.join(self.notes)}" if self.notes else "")


def _torch_tools():
    """The pieces of torch the trace runs on; a clear error where this torch lacks one."""
    pieces = {}
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        pieces["FakeTensorMode"] = FakeTensorMode
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
        from torch.testing._internal.distributed.fake_pg import FakeStore

        pieces["FakeStore"] = FakeStore
        from torch.distributed._tools.mem_tracker import MemTracker

        pieces["MemTracker"] = MemTracker
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        pieces["FSDPMemTracker"] = FSDPMemTracker
    except ImportError as e:
        raise TraceMemoryError(f"--trace-memory needs torch's fake tensors, fake process group and memory trackers "
                               f"(torch._subclasses.fake_tensor, torch.testing._internal.distributed.fake_pg, "
                               f"torch.distributed._tools); this torch {torch.__version__} lacks one ({e}); drop "
                               "--trace-memory (the formula's plan needs none of them)") from e
    return pieces


def check_trace_options(ns: argparse.Namespace) -> None:
    """The flags ``--trace-memory`` needs; raises :class:`TraceMemoryError` naming the flag and what works."""
    if not ns.dry_run:
        raise TraceMemoryError("--trace-memory traces the plan of --dry-run on fake tensors; add --dry-run (a "
                               "launched run reports its measured peak in its metrics)")
    if getattr(ns, "float8", False):
        raise TraceMemoryError("--trace-memory with --float8: torchao's float8 matmuls do not run on fake CPU "
                               "tensors; drop --float8 to trace the bf16 layout, or --trace-memory")


def _trace_namespace(ns: argparse.Namespace) -> "tuple[argparse.Namespace, list]":
    """The flags of the traced rank: the run's, with what cannot run on fake tensors replaced (and said)."""
    traced = copy.copy(ns)
    notes = []
    if ns.compile or ns.optimize:
        notes.append("eager layers (" + " and ".join(n for n, on in (("torch.compile", ns.compile),
                                                                      ("optimize_model", ns.optimize)) if on)
                     + " do not run on fake tensors; the formula is the eager layout's)")
    traced.compile, traced.optimize = False, False
    if ns.optimizer == "fused-adamw":  # a Triton kernel: torch's AdamW keeps the same state
        traced.optimizer = "adamw"
        notes.append("fused-adamw traced as torch.optim.AdamW")
    traced.init_from = None  # initialized weights take the bytes loaded ones would
    traced.checkpoint_dir = None
    return traced, notes


def _formula(ns: argparse.Namespace, facts, world: int) -> StepEstimate:
    from .layout import hardware, layout_of

    return estimate_step(facts.shape, layout_of(ns), hardware(ns, world), ns.global_batch, ns.seq)


@contextlib.contextmanager
def rank_in_fake_group(world: int, tools, mode: str):
    """This process as rank 0 of torch's fake process group of ``world`` ranks, for a run of one rank of the job
    (rank 0: the mesh puts pp outermost, so it holds the first stage, the one with the most in flight); yields
    the rank. Refused where a process group exists already; leaves no group and no seed behind (the trainer seeds
    the default generator)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise TraceMemoryError(f"--trace-memory {mode} makes a fake process group of the planned world, but this process already "
                               "has one (it runs under torchrun or --nproc); run the dry run in a single process "
                               "(without torchrun or --nproc)")
    rng = torch.random.get_rng_state()
    rank = 0
    dist.init_process_group("fake", rank=rank, world_size=world, store=tools["FakeStore"]())
    try:
        yield rank
    finally:
        dist.destroy_process_group()
        torch.random.set_rng_state(rng)


def trace_peak(ns: argparse.Namespace, facts, world: int) -> TracedPeak:
    """Build rank 0 of the ``world``-rank run of ``ns`` on fake tensors and a fake process group, run two training
    steps and return its traced peak beside the formula's. Leaves no process group, mode or seed behind."""
    from ..models.shape_probe import quiet_fake_tensors

    check_trace_options(ns)
    tools = _torch_tools()
    traced_ns, notes = _trace_namespace(ns)
    formula = _formula(traced_ns, facts, world)
    start = time.perf_counter()
    with rank_in_fake_group(world, tools, "fake") as rank:
        # the schedule's build tries shapes on fake tensors on purpose and catches the errors
        with quiet_fake_tensors():
            tensor_bytes, by_kind = _run_traced(traced_ns, rank, world, tools)
    other = formula.other_bytes  # what the formula allows for beyond tensors (a CUDA rank's workspace)
    return TracedPeak(rank, tensor_bytes, other, formula, by_kind, notes, time.perf_counter() - start)


@contextlib.contextmanager
def _meshes_on_real_tensors():
    """A DeviceMesh finds its ranks by computing on its rank tensors (``nonzero``, ``tolist``); FSDP2 makes one of
    the dp and tp dimensions inside the traced build, where fake tensors have no values to compute with. Those
    small tensors stay real: each mesh is made outside the fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


def _global_peak_only(tracker_class):
    """``tracker_class`` keeping only the peak over the whole rank. torch's trackers also update every tracked
    module's own peak after each op, looping over all the modules: a third of a 70B trace's time, for statistics
    the trace never reads. Where a torch keeps its peak elsewhere, the tracker's own update runs."""

    class GlobalPeak(tracker_class):
        def _update_peak_stats(self, peak_state) -> None:
            current, peaks, snapshots = (getattr(self, name, None)
                                         for name in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap"))
            if not all(isinstance(d, dict) for d in (current, peaks, snapshots)):
                return super()._update_peak_stats(peak_state)
            for device, snapshot in current.items():
                total = snapshot.get(_TOTAL, 0)
                if peaks.get(device, 0) < total:
                    peaks[device] = total
                    snapshots[device] = dict(snapshot)

    return GlobalPeak


#: the key of a tracker snapshot's total
_TOTAL = "Total"


def _tracker_of(tools, modules, optimizer, ns):
    """FSDPMemTracker where FSDP2 wraps the one module, called once per step (it follows FSDP2's states and
    refuses a module called twice); else MemTracker, whose statistics of a module start afresh at each of its
    calls (a pipeline stage or accumulation runs every microbatch through the modules; only the peak over all
    of them is read)."""
    from torch.distributed.fsdp import FSDPModule

    if ns.pp == 1 and ns.microbatches == 1 and len(modules) == 1 and isinstance(modules[0], FSDPModule):
        return _global_peak_only(tools["FSDPMemTracker"])(modules[0], optimizer), True

    class PeakTracker(_global_peak_only(tools["MemTracker"])):
        def _pre_fw_hook(self, module, inputs):
            if not self._mod_tracker.is_bw:
                self.memory_tracking.pop(module, None)
            super()._pre_fw_hook(module, inputs)

    tracker = PeakTracker()
    tracker.track_external(*modules, optimizer)
    return tracker, False


def _run_traced(ns: argparse.Namespace, rank: int, world: int, tools) -> "tuple[int, Dict[str, int]]":
    from .run import _Run

    if ns.pp > 1 and ns.pp_schedule not in _TRACED_SCHEDULES:
        raise TraceMemoryError(f"--trace-memory with --pp-schedule {ns.pp_schedule}: the trace runs the first "
                               f"rank's microbatches in the order of {', '.join(_TRACED_SCHEDULES)}; use one of "
                               "those, or drop --trace-memory")
    run = _Run(ns, rank, world, torch.device("cpu"))
    with warnings.catch_warnings():  # the fake backend takes no group timeout, and says so per group
        warnings.filterwarnings("ignore", message="Set timeout is now only supported")
        run.make_mesh()  # on real tensors: the mesh reads its ranks' values
    fake = tools["FakeTensorMode"](allow_non_fake_inputs=True)
    run.materialize_mode = fake
    with _meshes_on_real_tensors():
        run.build()
    modules = run._modules()
    tracker, per_step = _tracker_of(tools, modules, run.optimizer, ns)
    rows = ns.global_batch // ns.dp
    with fake, _meshes_on_real_tensors(), _packing_answered_as_the_run_would(ns):
        tokens = torch.randint(0, run.dims.vocab, (rows, ns.seq + 1))
        held: dict = {}  # the pipeline's receive buffers, kept from step to step as torch's stages do
        with tracker:
            for step in range(2):  # the first creates the optimizer's state, which the second finds in place
                if ns.pp > 1:
                    _first_rank_step(run, step, tokens[:, :-1], held)
                else:
                    run.train_step(step, tokens[:, :-1], tokens[:, 1:])
                if per_step:
                    tracker.reset_mod_stats()
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    by_kind = {str(getattr(k, "value", k)): int(v) for k, v in snapshot.items()}
    return int(by_kind.pop(_TOTAL, 0)), by_kind


@contextlib.contextmanager
def _packing_answered_as_the_run_would(ns: argparse.Namespace):
    """transformers' mask builder asks ``find_packed_sequence_indices`` whether the position ids restart within a
    row (sequences packed together); where they do not, it leaves causality to SDPA and builds no mask. On fake
    position ids it cannot read the values and answers "packed", so a traced step would build a ``[b, 1, s, s]``
    mask the run never holds (and, under a pipeline, send it to the next stage with a gradient buffer per
    microbatch: 1 GiB a microbatch of 4 rows at sequence 8192). The trainer's rows are one sequence each; the
    positions rank 0 holds are the plain count, or under context parallelism its two load-balanced chunks. The
    check is answered on those real positions, as the run's would be."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    def answered(position_ids, *args, **kwargs):
        if not is_fake(position_ids):
            return original(position_ids, *args, **kwargs)
        with unset_fake_temporarily():
            length = position_ids.shape[-1]
            if (ns.cp or 1) > 1:
                from ..distributed.context_parallel import local_positions

                held = local_positions(length * ns.cp, ns.cp, 0)
            else:
                held = torch.arange(length)
            packed = original(held.expand(position_ids.shape[0], -1))
        return None if packed is None else original(position_ids, *args, **kwargs)

    masking_utils.find_packed_sequence_indices = answered
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


#: pipeline schedules whose first rank the trace runs: their backward is one action per stage and microbatch
_TRACED_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


def _rank_actions(pipeline, ns: argparse.Namespace) -> "list[tuple[str, int, int]]":
    """``(F or B, microbatch, position among the rank's stages)`` in the order rank 0 runs them. One stage per rank:
    1F1B runs ``min(m, pp)`` forwards before the first backward (the ``pp - rank`` microbatches in flight on rank
    0), then one backward and one forward in turn; GPipe every forward, then every backward. Several stages per
    rank: the order torch's schedule computed for the rank (``pipeline_order``, made without communicating)."""
    m = ns.microbatches
    if len(pipeline.stage_modules) == 1:
        ahead = min(m, ns.pp) if ns.pp_schedule == "1F1B" else m
        order = [("F", k, 0) for k in range(ahead)]
        for k in range(ahead, m):
            order += [("B", k - ahead, 0), ("F", k, 0)]
        return order + [("B", k, 0) for k in range(m - ahead, m)]
    position = {index: i for i, index in enumerate(pipeline.stage_indices)}
    order = []
    for action in pipeline.schedule.pipeline_order[pipeline.pp_rank]:
        if action is None:
            continue  # an idle slot of the rank
        # the traced schedules' actions are forwards ("F") and whole backwards ("B")
        kind = str(getattr(action.computation_type, "value", action.computation_type))
        order.append((kind, action.microbatch_index, position[action.stage_index]))
    return order


def _first_rank_step(run, step: int, inputs: torch.Tensor, held: dict) -> None:
    """One training step of the first pipeline rank (rank 0), as the trainer's ``train_step`` runs it but for the
    schedule: torch's schedule agrees on the stages' shapes by sending pickled metadata between the pp ranks, which
    a fake process group does not carry, so this runs the rank's stages and microbatches itself, in the schedule's
    order (:func:`_rank_actions`). A later stage of the rank (interleaved schedules) gets what the stage before it
    sends, the first stage's outputs in shape. As torch's stages do, each stage keeps one receive buffer per
    microbatch for what comes from the neighbouring stages (the inputs of a later stage, the outputs' gradients),
    from step to step; FSDP2 reshards nothing after a backward and reduces the gradients only after the last."""
    from torch.distributed.fsdp import FSDPModule

    from .data import lr_at, _mix

    ns = run.ns
    pipeline = run.model
    modules = list(pipeline.stage_modules)
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(ns, step)
    torch.manual_seed(_mix(ns.seed, step, 2))
    m = ns.microbatches
    for module in modules:
        if isinstance(module, FSDPModule):
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)
    autocast = torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.autocast)
    in_flight: dict = {}
    boundary: list = []  # the first stage's outputs of a microbatch: what a later stage of the rank receives

    def received(position: int, k: int) -> list:
        # a stage after the second also receives the stages' anchor, a 0-d tensor that carries the gradients of
        # the values it relays (schedlang.distributed.pipeline.transport)
        names = [n.name for n in modules[position].graph.nodes if n.op == "placeholder"]
        shapes = boundary + ([torch.zeros((), requires_grad=True)] if names[-1:] == ["_pipeline_anchor"] else [])
        buffers = held.setdefault(("in", position), [None] * m)
        if buffers[k] is None:
            buffers[k] = [torch.empty_like(t) for t in shapes]
        return [b.detach().requires_grad_(t.requires_grad) for b, t in zip(buffers[k], shapes)]

    def forward(k: int, position: int) -> None:
        args = [inputs.chunk(m)[k].contiguous()] if position == 0 else received(position, k)
        with autocast:
            out = modules[position](*args)
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if position == 0 and not boundary:
            boundary.extend(out)
        outs = [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = held.setdefault(("grad", position), [None] * m)
        if grads[k] is None:
            grads[k] = [torch.empty_like(t) for t in outs]
        in_flight[(position, k)] = (outs, grads[k])

    def backward(k: int, position: int) -> None:
        outs, grads = in_flight.pop((position, k))
        torch.autograd.backward(outs, grads)

    for kind, k, position in _rank_actions(pipeline, ns):
        (forward if kind == "F" else backward)(k, position)
    for stage in pipeline.stages:
        stage.perform_reduce_grad(1)  # FSDP2's reduction after the last microbatch, as the schedule calls it
    pipeline._finish_gradients()
    run._clip()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)


def traced_json(traced: Optional[TracedPeak]) -> Dict[str, float]:
    """The keys ``--json`` adds for a traced plan."""
    if traced is None:
        return {}
    return {"traced_peak_gib": traced.peak_bytes / GIB, "traced_formula_peak_gib": traced.formula_bytes / GIB}

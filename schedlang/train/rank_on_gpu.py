"""``--dry-run --trace-memory gpu``: the peak rank of the planned job, run for real on this machine's GPU.

The fake-tensor trace (:mod:`schedlang.train.trace_memory`) counts the tensors a step holds. What a run asks of
the device is more: the caching allocator's reserve over those tensors, which depends on the order and the sizes
of the allocations and on the CUDA streams they are made on (FSDP2's collectives run on streams of their own, and
the allocator keeps a pool per stream), and what ``torch.compile``, float8 and the fused kernels allocate, none of
which run on fake tensors. Here rank 0 of the job (the first pipeline stage, which keeps the most microbatches in
flight under 1F1B; otherwise a rank like every other) joins torch's fake process group of the job's world size,
where every collective returns at once and leaves its output as it found it. The trainer builds the rank on the
GPU as the run would, with the same flags (compile, ``optimize_model``, float8, the fused optimizer), and runs
training steps on random tokens: the numbers it computes are meaningless (the collectives carry nothing), the
allocations are the run's. The caching allocator's peaks, allocated and reserved, are read after the steps.

So one GPU tells whether a rank of a 256-GPU job fits, under the allocator setting the run would have (the
trainer's expandable segments unless the environment names one), as long as the rank's own memory fits the GPU.

What it cannot see: the communication library's own buffers (NCCL allocates outside the caching allocator), and
the other ranks, whose peaks differ under a pipeline (the first holds the most activations; the last, the logits).
Expert parallelism exchanges token counts before it sends the tokens: with no real peers it cannot run.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings
from typing import Dict, Optional

import torch

from ..autotune.training_cost import GIB, StepEstimate
from .allocator import allocator_setting
from .trace_memory import TraceMemoryError, _first_rank_step, _formula, _torch_tools, rank_in_fake_group

#: training steps run: the first creates the optimizer's state (and compiles), the later ones run as a run's do
STEPS = 3


@dataclasses.dataclass
class RankOnGpu:
    """The peak rank run on a GPU: the allocator's peaks over its steps beside the formula's estimate."""

    rank: int
    world: int
    device_name: str
    allocator: str
    allocated_bytes: int
    reserved_bytes: int
    formula: StepEstimate
    steps: int
    seconds: float

    @property
    def formula_bytes(self) -> float:
        return self.formula.total_bytes

    @property
    def gap(self) -> float:
        """The allocated peak against the formula's: -0.04 is 4% below the formula."""
        return self.allocated_bytes / self.formula_bytes - 1.0

    def line(self) -> str:
        return (f"peak per rank: formula {self.formula_bytes / GIB:.3g} GiB; run on {self.device_name} as rank "
                f"{self.rank} of {self.world} (fake process group, {self.steps} steps in {self.seconds:.0f} s): "
                f"{self.allocated_bytes / GIB:.3g} GiB allocated ({100 * self.gap:+.1f}%), "
                f"{self.reserved_bytes / GIB:.3g} GiB reserved (allocator: {self.allocator})")


def check_gpu_options(ns: argparse.Namespace) -> None:
    """What ``--trace-memory gpu`` needs; raises :class:`TraceMemoryError` naming the flag and what works."""
    if not ns.dry_run:
        raise TraceMemoryError("--trace-memory gpu runs the peak rank of the plan of --dry-run; add --dry-run")
    if ns.device != "cuda":
        raise TraceMemoryError(f"--trace-memory gpu runs the rank on this machine's GPU, but --device is "
                               f"{ns.device}; use --device cuda, or --trace-memory fake (fake tensors, no GPU)")
    if not torch.cuda.is_available():
        raise TraceMemoryError("--trace-memory gpu needs a CUDA GPU on this machine (torch.cuda.is_available() is "
                               f"False, torch {torch.__version__}); trace on fake tensors instead (--trace-memory "
                               "fake), which needs no GPU")
    if (getattr(ns, "ep", None) or 1) > 1:
        raise TraceMemoryError(f"--trace-memory gpu with --ep {ns.ep}: expert parallelism exchanges its token counts "
                               "before it sends the tokens, which a fake process group cannot answer; use "
                               "--trace-memory fake (fake tensors), or plan without --ep")


def _run_namespace(ns: argparse.Namespace) -> argparse.Namespace:
    """The run's flags, less what would read or write files: initialized weights take the bytes loaded ones
    would, and nothing is saved."""
    run_ns = argparse.Namespace(**vars(ns))
    run_ns.init_from = None
    run_ns.checkpoint_dir = None
    return run_ns


def run_rank(ns: argparse.Namespace, world: int, device: torch.device, steps: int, before_steps=None) -> None:
    """Build rank 0 of the ``world``-rank run of ``ns`` on ``device`` in a fake process group and run ``steps``
    training steps on random tokens; ``before_steps(run)`` is called with the trainer's rank once it is built.
    Leaves no process group and no seed behind. (The steps' numbers are meaningless: the collectives carry
    nothing.)"""
    from ..models.shape_probe import quiet_fake_tensors
    from .run import _Run

    with rank_in_fake_group(world, _torch_tools(), "gpu") as rank:
        run = _Run(ns, rank, world, device)
        # the fake backend takes no group timeout, and says so per group; the schedule's build tries shapes on
        # fake tensors on purpose and catches the errors
        with warnings.catch_warnings(), quiet_fake_tensors():
            warnings.filterwarnings("ignore", message="Set timeout is now only supported")
            run.make_mesh()
            run.build()
        rows = ns.global_batch // ns.dp
        generator = torch.Generator(device=device).manual_seed(ns.seed)
        tokens = torch.randint(0, run.dims.vocab, (rows, ns.seq + 1), device=device, generator=generator)
        if before_steps is not None:
            before_steps(run)
        held: Dict = {}  # a pipeline's receive buffers, kept from step to step as torch's stages do
        for step in range(steps):
            if ns.pp > 1:
                # the schedule's shape handshake needs real peers: the rank's stages run in the schedule's order
                _first_rank_step(run, step, tokens[:, :-1], held)
            else:
                run.train_step(step, tokens[:, :-1], tokens[:, 1:])


def run_rank_on_gpu(ns: argparse.Namespace, facts, world: int, steps: int = STEPS) -> RankOnGpu:
    """Rank 0 of the ``world``-rank run of ``ns`` on this machine's GPU (:func:`run_rank`): the caching allocator's
    peaks over ``steps`` training steps beside the formula's estimate. Frees what it built."""
    check_gpu_options(ns)
    run_ns = _run_namespace(ns)
    formula = _formula(run_ns, facts, world)
    device = torch.device("cuda", torch.cuda.current_device())

    def reset_peaks(_run):
        # the build's own transients (a layer initialized, then sharded) are not the steps'
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

    start = time.perf_counter()
    try:
        run_rank(run_ns, world, device, steps, before_steps=reset_peaks)
        torch.cuda.synchronize(device)
    except torch.OutOfMemoryError as e:
        total = torch.cuda.get_device_properties(device).total_memory / GIB
        raise TraceMemoryError(f"--trace-memory gpu: the rank does not fit this GPU "
                               f"({torch.cuda.get_device_name(device)}, {total:.1f} GiB): {e}; run it on a GPU with more "
                               "memory, or use --trace-memory fake (fake tensors, no GPU)") from e
    finally:
        allocated = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
        torch.cuda.empty_cache()
    return RankOnGpu(0, world, torch.cuda.get_device_name(device), allocator_setting(), allocated, reserved,
                     formula, steps, time.perf_counter() - start)


def rank_on_gpu_json(result: Optional[RankOnGpu]) -> Dict:
    """The keys ``--json`` adds for a rank run on the GPU."""
    if result is None:
        return {}
    return {"gpu_allocated_peak_gib": result.allocated_bytes / GIB,
            "gpu_reserved_peak_gib": result.reserved_bytes / GIB,
            "gpu_formula_peak_gib": result.formula_bytes / GIB,
            "gpu_device": result.device_name, "gpu_allocator": result.allocator, "gpu_steps": result.steps}

"""Shared pieces of the benchmarks: timing, MFU, result files and their tables.

Every benchmark that trains a model reports rows of the same shape and writes them to
``bench/results/<YYYY-MM-DD>-<name>.json``::

    {"git_sha", "date", "device", "gpus", "torch", "triton", "transformers", "rows": [
        {"work", "variant", "role": "baseline" | "schedlang", "ms", "tokens_per_s", "mfu",
         "peak_mem_gib", "check", ...extra keys ("ms_runs", "layout", ...)}]}

Timing (:func:`time_steps`): a few warm-up steps (compilation, allocator, NCCL set-up), then
several *repeats* of a few steps each, timed with CUDA events (a wall clock on the CPU); the
figure reported is the **median** repeat, the typical case rather than the best, and every
repeat is kept in ``ms_runs``. Under torch.distributed each repeat is the slowest rank's.
``host_ms`` is the host's share: the wall time the CPU spends issuing one step (the loop up to
its last launch, before waiting for the GPU). Close to ``ms``, the step is bound by the host
(Python, launches, hooks); well below it, the GPU is the limit.

``gpu_clock`` (:class:`GpuClockSampler`) is what the GPU ran at during the timed repeats: the mean SM
clock, the mean power draw, and the share of samples in which the driver held the clock down to stay
under the power limit (of rank 0's GPU), and the energy per step (``j_per_step``: the driver's energy
counters over the repeats, summed over every rank's GPU, divided by the steps). An H100 or H200 at
700 W runs a dense training step power-capped, at clocks below its 1980 MHz; then a step that keeps
the GPU busier runs its GEMMs at a lower clock, and only less energy per step, not fewer idle gaps,
makes it faster.

Training benchmarks share the pieces below the timing: a global batch made on the host
(:func:`global_batch`), its rows per data-parallel rank (:func:`rows_of`), means over ranks
(:func:`world_mean`), the gradient norm over any layout (:func:`global_grad_norm`) and the
correctness verdict of a variant (:func:`check_losses`).

MFU counts the model FLOPs of a training step as the reference scripts in ``shared/bench`` do,
``6 * N_params * tokens + 12 * layers * hidden * seq * tokens`` (weights: forward + backward;
attention scores), against 989 TFLOP/s per GPU (dense bf16, H100 / H200 SXM).

README figures are rendered from these files with :func:`markdown_table`; files written by
several commands are merged with :func:`merge_files`::

    python bench/harness.py bench/results/2026-11-30-scale.json --columns layout
    python bench/harness.py --merge-into bench/results/2026-11-30-scale.json part1.json part2.json
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

#: dense bf16 peak of one H100 / H200 SXM GPU, FLOP/s
PEAK_BF16_FLOPS = 989e12
RESULTS_DIR = Path(__file__).resolve().parent / "results"
ROW_KEYS = ("work", "variant", "role", "ms", "tokens_per_s", "mfu", "peak_mem_gib", "check")
ROLES = ("baseline", "schedlang")


# ----------------------------------------------------------------------------------------------- FLOPs, MFU
def transformer_train_flops(n_params: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    """Model FLOPs of one training step over ``tokens`` tokens (sequences of ``seq``), as the reference scripts
    count them: 6 per parameter per token (forward 2, backward 4) plus the attention scores and their
    weighted sum, ``12 * layers * hidden * seq`` per token."""
    return 6.0 * n_params * tokens + 12.0 * layers * hidden * seq * tokens


def mfu(flops_per_step: float, ms: float, gpus: int, peak: float = PEAK_BF16_FLOPS) -> float:
    """Model FLOPs utilization of a step of ``ms`` milliseconds over ``gpus`` GPUs (a fraction, not a percent)."""
    if not ms or ms <= 0 or gpus <= 0:
        return 0.0
    return flops_per_step / (ms / 1e3) / (peak * gpus)


# ------------------------------------------------------------------------------------------------ timing
def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def local_gpu() -> torch.device:
    """This rank's GPU (``LOCAL_RANK`` under torchrun, else 0), made current; NVLink multicast (NVLS) is off for
    NCCL and symmetric memory, as on the machines the figures come from."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cuda", torch.cuda.current_device())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nvml_energy_mj(gpu_uuid: str) -> Optional[int]:
    """The driver's energy counter of the GPU ``gpu_uuid`` ("GPU-..."): millijoules since the driver
    loaded, read through NVML (``nvmlDeviceGetTotalEnergyConsumption``). None where NVML or the counter
    is missing. ctypes rather than the ``nvidia-ml-py`` package, so a bare GPU machine can read it."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        handle, energy = ctypes.c_void_p(), ctypes.c_ulonglong()
        if nvml.nvmlDeviceGetHandleByUUID(gpu_uuid.encode(), ctypes.byref(handle)) != 0:
            return None
        if nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(energy)) != 0:
            return None
        return int(energy.value)
    finally:
        nvml.nvmlShutdown()


class GpuClockSampler:
    """Samples the SM clock, power draw and power-cap state of ``device`` every ``interval_ms`` while
    in the ``with`` block, with ``nvidia-smi``, and reads the GPU's energy counter at both ends of it
    (absent, or not a CUDA device: nothing is sampled). ``summary()`` gives ``{"sm_mhz", "power_w",
    "power_capped", "samples", "energy_j"}`` (means; ``power_capped`` is the share of samples under the
    software power cap; ``energy_j`` the energy the GPU used in the block, None without the counter),
    or None without samples."""

    QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.sw_power_cap"

    def __init__(self, device: torch.device, interval_ms: int = 100):
        self.device, self.interval_ms = device, interval_ms
        self.process: Optional[subprocess.Popen] = None
        self.lines: List[str] = []
        self.uuid: Optional[str] = None
        self.energy_mj: List[Optional[int]] = []

    def __enter__(self) -> "GpuClockSampler":
        if self.device.type != "cuda":
            return self
        self.uuid = f"GPU-{torch.cuda.get_device_properties(self.device).uuid}"
        command = ["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                   f"-lms={self.interval_ms}", f"--id={self.uuid}"]
        try:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:  # no nvidia-smi on this machine
            self.process = None
        self.energy_mj = [nvml_energy_mj(self.uuid)]
        return self

    def __exit__(self, *exc) -> None:
        if self.uuid is not None:
            torch.cuda.synchronize(self.device)
            self.energy_mj.append(nvml_energy_mj(self.uuid))
        if self.process is not None:
            self.process.terminate()
            out, _ = self.process.communicate(timeout=10)
            self.lines = out.splitlines()

    def energy_j(self) -> Optional[float]:
        """Joules the GPU used inside the block, from its energy counter (None where it was not read)."""
        if len(self.energy_mj) != 2 or None in self.energy_mj:
            return None
        return (self.energy_mj[1] - self.energy_mj[0]) / 1e3

    def summary(self) -> Optional[Dict[str, float]]:
        samples = []
        for line in self.lines:
            parts = [p.strip() for p in line.split(",")]
            try:
                samples.append((float(parts[0]), float(parts[1]), parts[2].lower() == "active"))
            except (ValueError, IndexError):  # "[N/A]" fields, a cut last line
                continue
        if not samples:
            return None
        return {"sm_mhz": round(statistics.mean(s[0] for s in samples)),
                "power_w": round(statistics.mean(s[1] for s in samples), 1),
                "power_capped": round(sum(s[2] for s in samples) / len(samples), 2), "samples": len(samples),
                "energy_j": self.energy_j()}


def time_steps(step: Callable[[], Any], device: torch.device, warmup: int = 3, repeats: int = 5,
               iters: int = 5) -> Dict[str, Any]:
    """Run ``step`` ``warmup`` times, then ``repeats`` times ``iters`` steps; milliseconds per step.

    Returns ``{"ms": median repeat, "ms_runs": [each repeat], "warmup_s": wall time of the warm-up,
    "host_ms": median host time to issue a step, "gpu_clock": this rank's GPU clock and power over the
    repeats (:class:`GpuClockSampler`; None where not sampled)}`` (see the module docstring).
    On CUDA each repeat is timed with events on the current stream; under torch.distributed the ranks
    meet at a barrier before the repeats and each repeat counts as the slowest rank's time.
    """
    dist = _dist()
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    _synchronize(device)
    warm_s = time.perf_counter() - t0
    if dist is not None:
        dist.barrier()
    with GpuClockSampler(device) as clocks:
        runs, host = _timed_repeats(step, device, repeats, iters)
    runs = max_over_ranks(runs, device)
    host = max_over_ranks(host, device)
    gpu_clock = clocks.summary()
    energy = sum_over_ranks(None if gpu_clock is None else gpu_clock["energy_j"], device)
    if gpu_clock is not None and energy is not None:
        # the energy of every GPU of the step, so that rows of one and of several GPUs compare
        gpu_clock["energy_j"] = round(energy, 2)
        gpu_clock["j_per_step"] = round(energy / (repeats * iters), 2)
    return {"ms": statistics.median(runs), "ms_runs": [round(r, 3) for r in runs], "warmup_s": round(warm_s, 2),
            "host_ms": round(statistics.median(host), 3), "gpu_clock": gpu_clock}


def _timed_repeats(step: Callable[[], Any], device: torch.device, repeats: int, iters: int
                   ) -> Tuple[List[float], List[float]]:
    """Milliseconds per step of each repeat, and the host's share of each."""
    runs: List[float] = []
    host: List[float] = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            for _ in range(iters):
                step()
            host.append((time.perf_counter() - t) * 1e3 / iters)
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                step()
            runs.append((time.perf_counter() - t) * 1e3 / iters)
            host.append(runs[-1])
    return runs, host


def gpu_time_ms(fn: Callable[[], Any], repeats: int = 50, warmup: int = 5, flush_mb: int = 256,
                sleep_cycles: int = 5_000_000) -> float:
    """Median GPU time of one call of ``fn`` (ms), without the host's share.

    Timing a call of a few kernels with events (as ``triton.testing.do_bench`` does) measures the host
    whenever the host takes longer to issue them than the GPU to run them: autograd, a custom
    Function and Triton's launcher cost tens of µs per call, as long as a memory-bound kernel of a
    LLaMA layer. Here a ``torch.cuda._sleep`` of about 3 ms is queued before each call, so the host has
    issued the whole call before the GPU reaches it, and the events see only GPU time. The L2 cache is
    overwritten before each call (``flush_mb`` MB), as ``do_bench`` does."""
    flush = torch.empty(flush_mb * 2 ** 20, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(repeats):
        torch.cuda._sleep(sleep_cycles)
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def call_time_ms(fn: Callable[[], Any], device: torch.device, **gpu_options: Any) -> float:
    """One call of ``fn`` in ms: :func:`gpu_time_ms`'s median on a GPU (``gpu_options`` go to it), a single
    wall-clock call elsewhere (a CPU or interpreter run checks that a probe works, its times mean nothing)."""
    if device.type == "cuda":
        return gpu_time_ms(fn, **gpu_options)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def sum_over_ranks(value: Optional[float], device: torch.device) -> Optional[float]:
    """``value`` summed over all ranks; None when any rank has none (the value itself without torch.distributed)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return value
    t = torch.tensor([0.0 if value is None else value, 1.0 if value is None else 0.0], dtype=torch.float64,
                     device=device)
    dist.all_reduce(t)
    return None if t[1].item() else t[0].item()


def max_over_ranks(values: Sequence[float], device: torch.device) -> List[float]:
    """Element-wise maximum of ``values`` over all ranks (the values themselves without torch.distributed)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> Optional[float]:
    """Peak allocated memory since :func:`reset_peak_memory`, the largest over ranks (None on the CPU)."""
    if device.type != "cuda":
        return None
    return round(max_over_ranks([torch.cuda.max_memory_allocated(device) / 2 ** 30], device)[0], 2)


def free_memory(device: Optional[torch.device] = None) -> None:
    """Collect garbage and hand cached blocks back, between variants (the caller drops its references first)."""
    import gc

    gc.collect()
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------- rows
def make_row(work: str, variant: str, role: str, ms: Optional[float], tokens_per_step: int,
             flops_per_step: float, gpus: int, peak_mem_gib: Optional[float], check: str, **extra: Any) -> dict:
    """One result row; ``ms=None`` for a variant that did not run (``check`` says why)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    ran = ms is not None and ms > 0
    row = {"work": work, "variant": variant, "role": role,
           "ms": round(ms, 3) if ran else None,
           "tokens_per_s": round(tokens_per_step / (ms / 1e3), 1) if ran else None,
           "mfu": round(mfu(flops_per_step, ms, gpus), 4) if ran and gpus > 0 else None,
           "peak_mem_gib": peak_mem_gib, "check": check}
    row.update(extra)
    return row


def _median_fields(samples: Sequence[dict]) -> dict:
    """Per key, the median of the values the dicts have for it (None where none has one)."""
    out = {}
    for key in dict.fromkeys(k for d in samples for k in d):
        values = [d[key] for d in samples if d.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def combine_rounds(rows: Sequence[dict]) -> List[dict]:
    """One row per ``(work, variant)`` from rows measured in several rounds of the same process (every
    variant once per round, in the same order, so each meets the machine's drifts as often as the others):
    ``ms`` is the median of the rounds' medians, ``ms_rounds`` lists them, ``ms_runs`` holds every round's
    repeats, rate and MFU follow ``ms``, memory is the highest round's, each ``gpu_clock`` figure is the median
    of the rounds', and ``check`` is the first round's failure if any round failed. Other fields are the first
    round's (its profile, losses and notes)."""
    groups: Dict[tuple, List[dict]] = {}
    for row in rows:
        groups.setdefault((row["work"], row["variant"]), []).append(row)
    out = []
    for same in groups.values():
        first = dict(same[0])
        ran = [r for r in same if r.get("ms")]
        failed = next((r["check"] for r in same if r.get("check") != "ok"), None)
        if len(ran) == len(same) and ran:
            ms = statistics.median(r["ms"] for r in ran)
            base = ran[0]
            first.update(ms=round(ms, 3), ms_rounds=[r["ms"] for r in ran],
                         ms_runs=[x for r in ran for x in r.get("ms_runs", [])],
                         tokens_per_s=round(base["tokens_per_s"] * base["ms"] / ms, 1) if base.get("tokens_per_s")
                         else base.get("tokens_per_s"),
                         mfu=round(base["mfu"] * base["ms"] / ms, 4) if base.get("mfu") else base.get("mfu"),
                         peak_mem_gib=max((r["peak_mem_gib"] for r in ran if r.get("peak_mem_gib") is not None),
                                          default=None))
            if any(r.get("host_ms") is not None for r in ran):
                first["host_ms"] = round(statistics.median(r["host_ms"] for r in ran if r.get("host_ms") is not None),
                                         3)
            clocks = [r["gpu_clock"] for r in ran if r.get("gpu_clock")]
            if clocks:
                first["gpu_clock"] = _median_fields(clocks)
        if failed is not None:
            first["check"] = failed
        first["rounds"] = len(same)
        out.append(first)
    return out


def micro_row(work: str, variant: str, role: str, ms: Optional[float], check: str = "ok", **extra: Any) -> dict:
    """A row of a micro-benchmark (a kernel, an optimizer step, a copy): time only, no tokens or MFU; ratios
    against its baseline are by time."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    ran = ms is not None and ms > 0
    row = {"work": work, "variant": variant, "role": role, "ms": round(ms, 4) if ran else None, "tokens_per_s": None,
           "mfu": None, "peak_mem_gib": None, "check": check}
    row.update(extra)
    return row


def failed_row(work: str, variant: str, role: str, error: BaseException | str, **extra: Any) -> dict:
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    message = " ".join(str(message).split())[:400]
    return make_row(work, variant, role, None, 0, 0.0, 0, None,
                    message if message.startswith("FAIL") else f"FAIL {message}", **extra)


# ------------------------------------------------------------------------------------------------- files
def git_sha(root: Optional[Path] = None) -> str:
    """HEAD of the repository holding the benchmarks, ``+dirty`` when tracked files differ from it.

    ``SCHEDLANG_GIT_SHA`` overrides it, for a copy of the tree whose git metadata is not the checkout's
    (a benchmark machine that receives the files only)."""
    if os.environ.get("SCHEDLANG_GIT_SHA"):
        return os.environ["SCHEDLANG_GIT_SHA"]
    root = root or Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if not sha:
            return os.environ.get("SCHEDLANG_GIT_SHA", "unknown")
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root, capture_output=True,
                               timeout=10).returncode != 0
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("SCHEDLANG_GIT_SHA", "unknown")


def environment(gpus: int) -> Dict[str, Any]:
    """The header of a result file: revision, date, device and versions."""
    now = datetime.datetime.now(datetime.timezone.utc)
    out: Dict[str, Any] = {"git_sha": git_sha(), "date": now.date().isoformat(), "time": now.strftime("%H:%M:%S"),
                           "device": torch.cuda.get_device_name() if torch.cuda.is_available() and gpus else "cpu",
                           "gpus": gpus, "torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    if torch.cuda.is_available() and gpus:
        out["cuda"] = torch.version.cuda
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # NCCL not built in
            pass
    return out


def result_path(name: str, date: Optional[str] = None, directory: Optional[Path] = None) -> Path:
    return Path(directory or RESULTS_DIR) / f"{date or datetime.date.today().isoformat()}-{name}.json"


def write_results(name: str, rows: Iterable[dict], gpus: int, merge: bool = True,
                  directory: Optional[Path] = None, **header: Any) -> Path:
    """Write ``rows`` under the environment header to ``bench/results/<date>-<name>.json``; returns the path.

    With ``merge`` (default) a file of the same day is kept and updated: a new row replaces the row of
    the same ``work`` and ``variant``, other rows stay (so the works of a benchmark can run as separate
    commands). The header is the latest run's.
    """
    path = result_path(name, directory=directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    old_rows: List[dict] = []
    if merge and path.exists():
        try:
            old_rows = json.loads(path.read_text()).get("rows", [])
        except (OSError, ValueError):
            old_rows = []
    new_keys = {(r["work"], r["variant"]) for r in rows}
    kept = [r for r in old_rows if (r.get("work"), r.get("variant")) not in new_keys]
    data = environment(gpus)
    data.update(header)
    # rows of earlier runs keep the revision, command, machine and versions that measured them (the header is
    # the latest run's)
    for r in rows:
        _stamp(r, data)
    data["rows"] = kept + rows
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def write_probe(name: str, probe: Dict[str, Any], gpus: int, results_dir: Optional[str] = None) -> Path:
    """Write a probe's findings to ``<date>-<name>.json`` (``bench/results`` or ``results_dir``) and say where.

    A probe measures to decide, not to report: its file holds no rows (the README's tables take rows only),
    its findings sit in the header under ``probe``, and a file of the same day is replaced, not merged."""
    path = write_results(name, [], gpus=gpus, merge=False, directory=Path(results_dir) if results_dir else None,
                         probe=probe)
    print(f"wrote {path}")
    return path


# --------------------------------------------------------------------------------------- training steps
#: relative tolerances of :func:`check_losses`: the first loss against the eager plain model; the gradient
#: norm after the first backward and the loss after the warm-up steps against the work's first variant
TOL_BF16 = {"loss": 1e-2, "grad_norm": 5e-2, "trajectory": 2e-2, "grad_cosine": 0.98}
TOL_FP32 = {"loss": 1e-4, "grad_norm": 1e-3, "trajectory": 1e-3, "grad_cosine": 0.9999}
#: float8 GEMMs (e4m3 activations and weights, e5m2 gradients) turn the first gradient of a randomly initialized
#: model much more than bf16 rounding does: on LLaMA-1.1B (H100) torchao's float8 blocks and schedlang's both give
#: a cosine of 0.866 to 0.884 with the eager bf16 gradient. Wrong labels are far below this bound: 0.14 to 0.37
#: in bf16 and 0.30 in float8 (``bench/probe_grad_direction.py``, ``bench/results/2026-11-27-grad-direction.json``)
GRAD_COSINE_FLOAT8 = 0.8


def global_batch(vocab_size: int, rows: int, seq: int, device: torch.device, seed: int = 1):
    """``rows`` sequences of ``seq`` token ids and their labels (the ids shifted by one on the host, the last
    position ignored, so the logits are never sliced), from a fixed seed: the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (rows, seq), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    return ids.to(device), labels.to(device)


def rows_of(t: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    """The ``part``-th of ``parts`` equal blocks of rows (a data-parallel rank's share of the batch)."""
    n = t.shape[0] // parts
    return t[part * n:(part + 1) * n]


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


def world_mean(value: torch.Tensor, device: torch.device) -> float:
    """Mean over all ranks (a tensor-parallel group holds one value several times, so this is the mean over
    the data-parallel ranks, each of which trains on the same number of tokens)."""
    v = value.detach()
    if isinstance(v, _dtensor_cls()):
        v = v.full_tensor()
    v = v.float().reshape(()).to(device).clone()
    dist = _dist()
    if dist is not None and dist.get_world_size() > 1:
        dist.all_reduce(v)
        v /= dist.get_world_size()
    return float(v)


def global_grad_norm(params) -> float:
    """L2 norm of the whole gradient across every layout: a DTensor's sum of squares is reduced over its mesh,
    a plain tensor's is this rank's (plain gradients are replicated over the ranks that hold them)."""
    import logging
    import math

    DTensor = _dtensor_cls()
    # a 2-D (dp x tp) partial sum is reduced one dimension at a time; DTensor warns about that each time
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    total = 0.0
    for p in params:
        g = p.grad
        if g is None:
            continue
        sq = g.float().pow(2).sum()
        if isinstance(sq, DTensor):
            sq = sq.full_tensor()
        total += float(sq)
    return math.sqrt(total)


#: path segments that wrappers add to parameter names (torch.compile, DDP, activation checkpointing); the
#: gradient fingerprint names parameters as the plain model does
WRAPPER_SEGMENTS = ("_orig_mod", "module", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def plain_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def grad_fingerprint(named_params, directions: int = 4) -> Dict[str, List[float]]:
    """Per parameter (by its plain name), the inner products of its whole gradient with ``directions`` fixed
    random directions, seeded by the name: a few numbers per tensor whose cosine with another run's tells
    whether the two gradients point the same way (random projections keep inner products on average).

    The loss at a random initialization is about ln(vocab) whatever the labels, and so is the gradient's
    norm; its direction is not: labels shifted wrong, a dropped residual or a wrong shard turn it. A DTensor
    gradient is gathered whole first (every rank computes the same numbers), one parameter at a time."""
    import zlib

    DTensor = _dtensor_cls()
    out: Dict[str, List[float]] = {}
    for name, p in named_params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            g = g.full_tensor()
        g = g.detach().float().flatten()
        gen = torch.Generator(device=g.device).manual_seed(zlib.crc32(plain_name(name).encode()))
        out[plain_name(name)] = [float(torch.dot(torch.randn(g.numel(), generator=gen, device=g.device), g))
                                 for _ in range(directions)]
    return out


def world_mean_fingerprint(fingerprint: Dict[str, List[float]], device: torch.device) -> Dict[str, List[float]]:
    """The mean over ranks of per-rank fingerprints (each rank's gradient of its own rows' mean loss; with the
    same number of rows and tokens per rank, their mean is the whole batch's)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return fingerprint
    names = sorted(fingerprint)
    t = torch.tensor([fingerprint[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(names, t.tolist()))


def fingerprint_cosine(a: Dict[str, List[float]], b: Dict[str, List[float]]) -> Tuple[float, int, int]:
    """Cosine of two fingerprints over the parameters both have; with how many they share and how many ``b``
    (the reference) has."""
    import math

    common = sorted(set(a) & set(b))
    x = [v for n in common for v in a[n]]
    y = [v for n in common for v in b[n]]
    dot = sum(i * j for i, j in zip(x, y))
    norm = math.sqrt(sum(i * i for i in x)) * math.sqrt(sum(j * j for j in y))
    return (dot / norm if norm else float("nan")), len(common), len(b)


def check_losses(losses: Sequence[float], grad_norm: float, eager_loss: float, anchor: Optional[dict],
                 tol: Dict[str, float], fingerprint: Optional[Dict[str, List[float]]] = None,
                 eager_fingerprint: Optional[Dict[str, List[float]]] = None) -> Dict[str, Any]:
    """A variant's verdict, ``"ok"`` or ``"FAIL <why>"``: its first loss against the eager plain model's on the
    same batch; the direction of its first gradient against the eager model's (``fingerprint`` against
    ``eager_fingerprint``, :func:`grad_fingerprint`: their cosine at least ``tol["grad_cosine"]``, over every
    parameter the eager model has); and (given the work's first variant that passed, ``anchor``:
    ``{"variant", "losses", "grad_norm"}``) its gradient norm after the first backward and its loss at every
    warm-up step after the first (the batch repeats, so a correct model memorizes it along the same path)."""
    import math

    problems = []
    first = losses[0] if losses else float("nan")
    if not abs(first - eager_loss) <= tol["loss"] * abs(eager_loss):
        problems.append(f"first loss {first:.4f} vs eager {eager_loss:.4f}")
    cosine = None
    if fingerprint is not None and eager_fingerprint is not None:
        cosine, shared, wanted = fingerprint_cosine(fingerprint, eager_fingerprint)
        if shared < wanted:
            missing = sorted(set(eager_fingerprint) - set(fingerprint))
            problems.append(f"gradients of {wanted - shared} of {wanted} parameters missing (e.g. {missing[0]})")
        if not cosine >= tol["grad_cosine"]:
            problems.append(f"first gradient's direction: cosine {cosine:.4f} with eager's (at least "
                            f"{tol['grad_cosine']})")
    if anchor is not None:
        if not abs(grad_norm - anchor["grad_norm"]) <= tol["grad_norm"] * abs(anchor["grad_norm"]):
            problems.append(f"grad norm {grad_norm:.4g} vs {anchor['variant']} {anchor['grad_norm']:.4g}")
        # every step's loss, not only the last: a wrong update can come back onto the anchor's path a step
        # later (a vocabulary-parallel embedding updated from other rows of its gradient did, on the tiny models)
        for step, (loss, expected) in enumerate(zip(losses[1:], anchor["losses"][1:]), start=2):
            if not abs(loss - expected) <= tol["trajectory"] * abs(expected):
                problems.append(f"loss of step {step} {loss:.4f} vs {anchor['variant']} {expected:.4f}")
                break
    if any(not math.isfinite(x) for x in list(losses) + [grad_norm]):
        problems.append("non-finite loss or gradient")
    return {"check": "ok" if not problems else "FAIL " + "; ".join(problems),
            "loss_first": round(first, 5), "loss_eager": round(eager_loss, 5), "grad_norm": round(grad_norm, 5),
            "grad_cosine": None if cosine is None else round(cosine, 6), "losses": [round(x, 5) for x in losses]}


def profile_steps(step: Callable[[], Any], directory: Path, name: str, steps: int = 3) -> Path:
    """Run ``steps`` steps under torch.profiler (CPU and CUDA activity) and write a Chrome trace
    ``<directory>/<name>.json`` (one per rank under torch.distributed); returns its path."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    dist = _dist()
    suffix = f"-rank{dist.get_rank()}" if dist is not None else ""
    path = Path(directory) / f"{name}{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return path


# ------------------------------------------------------------------------------------------------ tables
def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "ms":
        return f"{value:.1f}" if value >= 10 else f"{value:.3f}"
    if kind == "tok":
        return f"{value:,.0f}"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "gib":
        return f"{value:.1f}"
    return str(value)


def markdown_table(rows: Iterable[dict], extra_columns: Sequence[str] = ()) -> str:
    """Rows as a markdown table, one block of rows per work, with each row's speed against its named baseline
    (``row["baseline"]``, a variant of the same work) or else the work's fastest baseline (tokens/s ratio;
    > 1 is faster)."""
    rows = list(rows)
    best = _best_baselines(rows)
    head = ["work", "variant", "role", "step ms", "tokens/s", "MFU", "peak GiB", "vs baseline",
            *extra_columns, "check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    for r in rows:
        cells = [r.get("work"), r.get("variant"), r.get("role"), _fmt(r.get("ms"), "ms"),
                 _fmt(r.get("tokens_per_s"), "tok"), _fmt(r.get("mfu"), "pct"), _fmt(r.get("peak_mem_gib"), "gib"),
                 _ratio(r, best), *[_fmt(r.get(c), "") for c in extra_columns], r.get("check")]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def text_table(rows: Iterable[dict]) -> str:
    """A short fixed-width table for a terminal."""
    rows = list(rows)
    best = _best_baselines(rows)
    out = [f"{'work':18s} {'variant':36s} {'ms':>9s} {'tok/s':>11s} {'MFU':>6s} {'GiB':>6s} {'vs base':>7s}  check"]
    for r in rows:
        out.append(f"{str(r.get('work'))[:18]:18s} {str(r.get('variant'))[:36]:36s} {_fmt(r.get('ms'), 'ms'):>9s} "
                   f"{_fmt(r.get('tokens_per_s'), 'tok'):>11s} {_fmt(r.get('mfu'), 'pct'):>6s} "
                   f"{_fmt(r.get('peak_mem_gib'), 'gib'):>6s} {_ratio(r, best):>7s}  {str(r.get('check'))[:120]}")
    return "\n".join(out)


def _speed(row: dict) -> Optional[float]:
    """Higher is faster: tokens per second, or for micro-benchmarks the inverse of the time."""
    if row.get("tokens_per_s"):
        return row["tokens_per_s"]
    return 1.0 / row["ms"] if row.get("ms") else None


def _best_baselines(rows: List[dict]) -> Dict[Any, float]:
    """Per work, the speed of its fastest baseline row; per (work, variant), each row's speed (see :func:`_speed`)."""
    best: Dict[Any, float] = {}
    for r in rows:
        speed = _speed(r)
        if speed:
            best[(r.get("work"), r.get("variant"))] = speed
            if r.get("role") == "baseline":
                best[r["work"]] = max(best.get(r["work"], 0.0), speed)
    return best


def ratio_to_baseline(row: dict, rows: Iterable[dict]) -> Optional[float]:
    """``row``'s speed (tokens/s, or 1 / ms) over its named baseline's (``row["baseline"]``, the same work in
    ``rows``), or over the work's fastest baseline when it names none; None when either did not run."""
    return _ratio_value(row, _best_baselines(list(rows)))


def ratio_to_fastest_baseline(row: dict, rows: Iterable[dict]) -> Optional[float]:
    """``row``'s speed over the fastest baseline row of its work in ``rows``, whichever it names; None when
    either did not run."""
    speed, best = _speed(row), _best_baselines(list(rows)).get(row.get("work"))
    return speed / best if speed and best else None


def _ratio_value(row: dict, best: Dict[Any, float]) -> Optional[float]:
    speed = _speed(row)
    if not speed:
        return None
    ref = best.get((row.get("work"), row["baseline"])) if row.get("baseline") else best.get(row.get("work"))
    return speed / ref if ref else None


def _ratio(row: dict, best: Dict[Any, float]) -> str:
    value = _ratio_value(row, best)
    return "-" if value is None else f"{value:.2f}x"


#: what each row keeps of its file's header, so that a row merged into another file still names its run
ROW_HEADER_KEYS = ("git_sha", "command", "date", "time", "device", "gpus", "torch", "triton", "transformers")


def _stamp(row: dict, header: dict) -> dict:
    for key in ROW_HEADER_KEYS:
        if key in header:
            row.setdefault(key, header[key])
    return row


def merge_files(target: Path, sources: Sequence[Path]) -> Path:
    """Merge the rows of result files into ``target`` (created or updated): later files win for the same
    ``work`` and ``variant``; the header is the last source's, and every row keeps its own file's revision,
    date, device and versions (:data:`ROW_HEADER_KEYS`). For benchmarks run as several commands."""
    target = Path(target)
    data: Dict[str, Any] = json.loads(target.read_text()) if target.exists() else {"rows": []}
    if data["rows"]:
        data["rows"] = [_stamp(r, data) for r in data["rows"]]
    for src in sources:
        new = json.loads(Path(src).read_text())
        new["rows"] = [_stamp(r, new) for r in new["rows"]]
        keys = {(r["work"], r["variant"]) for r in new["rows"]}
        rows = [r for r in data["rows"] if (r.get("work"), r.get("variant")) not in keys] + new["rows"]
        data = {**{k: v for k, v in new.items() if k != "rows"}, "rows": rows}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=2) + "\n")
    return target


def main(argv: Optional[Sequence[str]] = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="print result files as markdown tables, or merge them")
    parser.add_argument("files", nargs="+")
    parser.add_argument("--columns", default="", help="extra row keys to show, comma-separated (e.g. layout)")
    parser.add_argument("--merge-into", default=None, help="merge the files' rows into this file, then print it")
    args = parser.parse_args(argv)
    extra = [c for c in args.columns.split(",") if c]
    files = [merge_files(Path(args.merge_into), [Path(f) for f in args.files])] if args.merge_into else args.files
    for f in files:
        data = json.loads(Path(f).read_text())
        print(f"{data.get('date')} · {data.get('device')} x{data.get('gpus')} · torch {data.get('torch')} · "
              f"triton {data.get('triton')} · transformers {data.get('transformers')} · {data.get('git_sha')}\n")
        print(markdown_table(data["rows"], extra))
        print()


if __name__ == "__main__":
    main()

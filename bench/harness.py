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
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], Any], device: torch.device, warmup: int = 3, repeats: int = 5,
               iters: int = 5) -> Dict[str, Any]:
    """Run ``step`` ``warmup`` times, then ``repeats`` times ``iters`` steps; milliseconds per step.

    Returns ``{"ms": median repeat, "ms_runs": [each repeat], "warmup_s": wall time of the warm-up}``.
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
    runs: List[float] = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                step()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                step()
            runs.append((time.perf_counter() - t) * 1e3 / iters)
    runs = max_over_ranks(runs, device)
    return {"ms": statistics.median(runs), "ms_runs": [round(r, 3) for r in runs], "warmup_s": round(warm_s, 2)}


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


def failed_row(work: str, variant: str, role: str, error: BaseException | str, **extra: Any) -> dict:
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    message = " ".join(str(message).split())[:400]
    return make_row(work, variant, role, None, 0, 0.0, 0, None,
                    message if message.startswith("FAIL") else f"FAIL {message}", **extra)


# ------------------------------------------------------------------------------------------------- files
def git_sha(root: Optional[Path] = None) -> str:
    """HEAD of the repository holding the benchmarks, ``+dirty`` when tracked files differ from it."""
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
    out: Dict[str, Any] = {"git_sha": git_sha(), "date": datetime.date.today().isoformat(),
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
    data["rows"] = kept + rows
    path.write_text(json.dumps(data, indent=2) + "\n")
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
    """Rows as a markdown table, one block of rows per work, with each row's speed against the work's
    fastest baseline (tokens/s ratio; > 1 is faster)."""
    rows = list(rows)
    best = _best_baselines(rows)
    head = ["work", "variant", "role", "step ms", "tokens/s", "MFU", "peak GiB", "vs best baseline",
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


def _best_baselines(rows: List[dict]) -> Dict[str, float]:
    """Per work, the most tokens per second of a baseline row."""
    best: Dict[str, float] = {}
    for r in rows:
        if r.get("role") == "baseline" and r.get("tokens_per_s"):
            best[r["work"]] = max(best.get(r["work"], 0.0), r["tokens_per_s"])
    return best


def _ratio(row: dict, best: Dict[str, float]) -> str:
    if row.get("tokens_per_s") and row.get("work") in best:
        return f"{row['tokens_per_s'] / best[row['work']]:.2f}x"
    return "-"


def merge_files(target: Path, sources: Sequence[Path]) -> Path:
    """Merge the rows of result files into ``target`` (created or updated): later files win for the same
    ``work`` and ``variant``; the header is the last source's. For benchmarks run as several commands."""
    target = Path(target)
    data: Dict[str, Any] = json.loads(target.read_text()) if target.exists() else {"rows": []}
    for src in sources:
        new = json.loads(Path(src).read_text())
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

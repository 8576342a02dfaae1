"""What saving a checkpoint costs the training step: synchronous DCP saves against asynchronous ones.

The model and the step are the trainer's own (``schedlang.train``: the same build, layout, optimizer and
loss), by default LLaMA-1.1B on 2 GPUs with FSDP2 (dp2), bf16, global batch 8 x 2048. After warm-up,
each row times steps on the GPU's clock (synchronized, wall time):

* ``no-save``: plain steps; ``ms`` is the median step.
* ``sync-save``: a step followed by ``schedlang.save_checkpoint`` (every rank writes its shards; the
  checkpoint is complete when the call returns); ``ms`` is the median of step + save, and
  ``save_ms`` what the save adds to the step.
* ``async-save`` / ``async-save-pinned``: a step followed by ``AsyncCheckpointer.save``, which returns
  once the state is copied to host memory (``save_ms``: what the step waits for), then the write goes
  on in the background during the next ``--steps-between`` steps; ``overlap_ms`` is how much slower
  those steps ran than ``no-save`` (summed), ``write_s`` the time from the save's start until the
  checkpoint was visible. ``-pinned`` keeps a pinned host copy between saves (a faster device-to-host
  copy, at the cost of that host memory for the run).

Each save is checked complete (its manifest matches its files) and removed before the next one, so
the disk holds one checkpoint at a time (about 13 GB for LLaMA-1.1B with AdamW).

Usage::

    torchrun --nproc_per_node=2 bench/bench_checkpoint.py                 # LLaMA-1.1B dp2, 2 GPUs
    python bench/bench_checkpoint.py --tiny                               # the tiny LLaMA on the CPU: checks the script

Rows go to ``bench/results/<date>-checkpoint-save.json`` (``bench/harness.py``: git revision, device,
versions), work ``llama-1.1b-dp2-save`` (``llama-tiny-save`` with ``--tiny``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/harness.py)

VARIANTS = ("no-save", "sync-save", "async-save", "async-save-pinned")


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _dir_gib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30


class Trainer:
    """The trainer's run (model, optimizer, step) on this rank, and its batches."""

    def __init__(self, args, rank: int, world: int, device: torch.device):
        from schedlang.train.data import TokenBatches
        from schedlang.train.flags import build_parser, validate
        from schedlang.train.run import _Run

        flags = ["--model", "llama", "--config", args.config, "--dp", str(world), "--global-batch",
                 str(args.global_batch), "--seq", str(args.seq), "--dtype", args.dtype, "--steps", "1000000",
                 "--device", device.type, "--optimizer", args.optimizer]
        if args.compile:
            flags.append("--compile")
        ns = build_parser().parse_args(flags)
        validate(ns, world)
        self.run = _Run(ns, rank, world, device)
        self.run.make_mesh()
        self.run.build()
        self.batches = TokenBatches(ns.data, self.run.dims.vocab, ns.seed, ns.global_batch, ns.seq)
        self.device, self.step_number = device, 0
        self.tokens_per_step = ns.global_batch * ns.seq
        self.flops_per_step = self.tokens_per_step * (6 * self.run.flops_params
                                                      + 12 * self.run.dims.layers * self.run.dims.hidden * ns.seq)

    def step(self) -> float:
        """One training step; its wall time in ms (the step reads its loss back, which waits for the GPU)."""
        self.step_number += 1
        tokens = self.batches.batch(self.step_number)
        _sync(self.device)
        t0 = time.perf_counter()
        self.run.step(self.step_number, tokens)
        _sync(self.device)
        return 1e3 * (time.perf_counter() - t0)


def _slowest(ms: float, device: torch.device) -> float:
    """The slowest rank's time: the step is as slow as its slowest rank."""
    return harness.max_over_ranks([ms], device)[0] if dist.is_initialized() else ms


def _measure_save(trainer: Trainer, saver, root: Path, args, baseline_ms: float) -> Dict[str, object]:
    """``--saves`` times: a step, then a save (``saver``: an ``AsyncCheckpointer``, or None for a synchronous
    save); the background write (if any) during the next steps."""
    import schedlang
    from schedlang.checkpoint.dcp import checkpoint_problem

    model, optimizer = trainer.run.model, trainer.run.optimizer

    rank = dist.get_rank() if dist.is_initialized() else 0
    device = trainer.device
    with_save, blocking, overlap, write_s, sizes, checks = [], [], [], [], [], []
    for i in range(args.saves):
        path = root / f"step-{trainer.step_number + 1:08d}"
        _sync(device)
        t0 = time.perf_counter()
        step_ms = trainer.step()
        t_save = time.perf_counter()
        if saver is None:
            schedlang.save_checkpoint(str(path), model, optimizer, step=trainer.step_number)
            pending = None
        else:
            pending = saver.save(str(path), model, optimizer, step=trainer.step_number)
        _sync(device)
        t1 = time.perf_counter()
        with_save.append(_slowest(1e3 * (t1 - t0), device))
        blocking.append(_slowest(1e3 * (t1 - t_save), device))
        slower, seen_done = 0.0, None
        for _ in range(args.steps_between):
            slower += _slowest(trainer.step(), device) - baseline_ms
            if pending is not None and seen_done is None and pending.done():
                seen_done = time.perf_counter()
        if pending is not None:
            saver.wait()
            seen_done = seen_done or time.perf_counter()
        _barrier()
        write_s.append(_slowest((seen_done or t1) - t_save, device))
        overlap.append(slower)
        if rank == 0:
            problem = checkpoint_problem(path)
            checks.append(problem)
            sizes.append(_dir_gib(path))
            shutil.rmtree(path, ignore_errors=True)
        _barrier()
        log(rank, f"  save {i + 1}/{args.saves}: step + save {with_save[-1]:.1f} ms (step alone {step_ms:.1f}), "
                  f"the step waited {blocking[-1]:.1f} ms, the next {args.steps_between} steps {slower:+.1f} ms, "
                  f"visible after {write_s[-1]:.2f} s")
    problems = [p for p in checks if p]
    return {"ms": statistics.median(with_save), "ms_runs": [round(v, 3) for v in with_save],
            "save_ms": round(statistics.median(blocking), 3), "overlap_ms": round(statistics.median(overlap), 3),
            "write_s": round(statistics.median(write_s), 3), "checkpoint_gib": round(max(sizes), 3) if sizes else None,
            "check": "ok" if not problems else f"FAIL incomplete checkpoint: {problems[0]}"}


def main(argv: Optional[List[str]] = None) -> List[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=None, help="the trainer's --config (default: 1b; tiny with --tiny)")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step (default 8; 2 with --tiny)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; 32 with --tiny)")
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16"], help="default bf16 (fp32 with --tiny)")
    parser.add_argument("--optimizer", default="adamw", help="the trainer's --optimizer")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compile the layers (default: yes on a GPU)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--warmup", type=int, default=3, help="steps before anything is timed")
    parser.add_argument("--repeats", type=int, default=8, help="plain steps timed for no-save")
    parser.add_argument("--saves", type=int, default=3, help="saves timed per variant; the median is reported")
    parser.add_argument("--steps-between", type=int, default=6, help="steps after each save (the background write)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where the checkpoints are written (one at a time; default: a new temporary directory)")
    parser.add_argument("--tiny", action="store_true", help="the tiny LLaMA in fp32 on the CPU: checks the script")
    parser.add_argument("--name", default=None, help="result file name (default: checkpoint-save, -tiny with --tiny)")
    parser.add_argument("--results-dir", default=None, help="where the JSON goes (default: bench/results)")
    args = parser.parse_args(argv)
    args.config = args.config or ("tiny" if args.tiny else "1b")
    args.global_batch = args.global_batch or (2 if args.tiny else 8)
    args.seq = args.seq or (32 if args.tiny else 2048)
    args.dtype = args.dtype or ("fp32" if args.tiny else "bf16")
    use_cuda = torch.cuda.is_available() and not args.tiny
    args.compile = use_cuda if args.compile is None else args.compile
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}: valid are {', '.join(VARIANTS)}")
    if use_cuda:
        device = harness.local_gpu()
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=900),
                                **({"device_id": device} if use_cuda else {}))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    from schedlang.checkpoint import AsyncCheckpointer

    trainer = Trainer(args, rank, world, device)
    own_dir = args.checkpoint_dir is None
    root = Path(args.checkpoint_dir or (tempfile.mkdtemp(prefix="schedlang-save-bench-") if rank == 0 else ""))
    if own_dir and dist.is_initialized():  # rank 0's temporary directory, on this host's file system
        shared = [str(root)]
        dist.broadcast_object_list(shared, src=0)
        root = Path(shared[0])
    root.mkdir(parents=True, exist_ok=True)
    log(rank, f"{world} rank(s) on {device.type}: llama {args.config}, dp={world}, {args.dtype}, global batch "
              f"{args.global_batch} x {args.seq}; checkpoints in {root}")
    for _ in range(args.warmup):
        trainer.step()
    plain = [_slowest(trainer.step(), device) for _ in range(args.repeats)]
    baseline_ms = statistics.median(plain)
    log(rank, f"no-save: {baseline_ms:.1f} ms per step (median of {len(plain)})")
    work = f"llama-{args.config}-dp{world}-save" if args.config in ("1b", "tiny") else f"llama-dp{world}-save"
    work = work.replace("llama-1b", "llama-1.1b")
    gpus = world if use_cuda else 0
    common = {"layout": trainer.run.layout(), "dtype": args.dtype, "optimizer": args.optimizer,
              "steps_between": args.steps_between, "saves": args.saves}

    def row(variant: str, role: str, ms: float, **extra) -> dict:
        return harness.make_row(work, variant, role, ms, trainer.tokens_per_step, trainer.flops_per_step, gpus,
                                harness.peak_memory_gib(device), extra.pop("check", "ok"), **common, **extra)

    rows = []
    if "no-save" in variants:
        rows.append(row("no-save", "baseline", baseline_ms, ms_runs=[round(v, 3) for v in plain]))
    for variant in [v for v in variants if v != "no-save"]:
        log(rank, f"{variant}:")
        saver = None if variant == "sync-save" else \
            AsyncCheckpointer(timeout=900, pin_memory=variant.endswith("-pinned") and use_cuda)
        measured = _measure_save(trainer, saver, root, args, baseline_ms)
        ms = measured.pop("ms")
        rows.append(row(variant, "baseline" if variant == "sync-save" else "schedlang", ms, **measured))
        del saver
        if use_cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        name = args.name or ("checkpoint-save-tiny" if args.tiny else "checkpoint-save")
        path = harness.write_results(name, rows, gpus=gpus, directory=Path(args.results_dir) if args.results_dir
                                     else None, ranks=world,
                                     command=" ".join(["bench/bench_checkpoint.py"] + (argv if argv is not None
                                                                                        else sys.argv[1:])))
        for r in rows:
            extra = (f"  save {r['save_ms']:.1f} ms, overlap {r['overlap_ms']:+.1f} ms, visible after {r['write_s']:.2f} s, "
                     f"{r['checkpoint_gib']:.2f} GiB" if "save_ms" in r else "")
            print(f"{r['variant']:>18}: {r['ms']:.1f} ms{extra}  [{r['check']}]")
        print(f"\nwrote {path}")
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
    _barrier()
    return rows


if __name__ == "__main__":
    main()

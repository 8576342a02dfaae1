"""The training loop of one rank: steps, metrics (tokens/s, MFU, peak memory) and the summary."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from .data import TokenBatches
from .flags import TrainError, _device_type, _fail
from .resume import finish_saves, open_metrics
from .run import _Run

#: dense bf16 peak of one H100 / H200 (SXM), the denominator of the reported MFU
PEAK_FLOPS_PER_GPU = 989e12


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # peak resident set, KiB on Linux
    return kib / 2**20


def _max_over_ranks(value: float, world: int, device: torch.device) -> float:
    if world == 1:
        return value
    import torch.distributed as dist

    buf = torch.tensor([value], device=device, dtype=torch.float64 if device.type == "cpu" else torch.float32)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return float(buf)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def train(ns: argparse.Namespace, rank: int = 0, world: int = 1) -> Optional[Dict[str, Any]]:
    """Run the training loop on this rank (process group already initialized when ``world > 1``).

    Returns the summary on rank 0 (``None`` elsewhere).
    """
    device_type = _device_type(ns)
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local_world > 1:  # ranks sharing the host's cores: no oversubscription
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    run = _Run(ns, rank, world, device)
    run.make_mesh()
    run.build()
    batches = TokenBatches(ns.data, run.dims.vocab, ns.seed, ns.global_batch, ns.seq)
    start = run.load() if ns.resume else 0
    last = ns.stop_after or ns.steps
    if start >= last:
        _fail(f"--resume: the checkpoint is at step {start}, nothing left to run up to step {last}")
    is_main = rank == 0
    metrics = open_metrics(ns.metrics, start if ns.resume else None) if (ns.metrics and is_main) else None
    layout = run.layout()
    tokens_per_step = ns.global_batch * ns.seq
    flops_per_token = 6 * run.flops_params + 12 * run.dims.layers * run.dims.hidden * ns.seq
    peak = PEAK_FLOPS_PER_GPU * world
    if is_main:
        _progress(f"schedlang train: {ns.model} {ns.config} ({run.n_params / 1e6:.1f}M parameters), {layout}, "
                  f"{world} rank(s) on {device.type}, global batch {ns.global_batch} x {ns.seq} tokens, "
                  f"steps {start + 1}..{last} of {ns.steps}")
    history: List[Dict[str, Any]] = []
    t_run = time.perf_counter()
    try:
        for step in range(start + 1, last + 1):
            tokens = batches.batch(step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = run.step(step, tokens)  # the loss is read back, which waits for the step
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            mem = _max_over_ranks(_memory_gib(device), world, device)
            tps = tokens_per_step / dt
            rec = {"step": step, "loss": out["loss"], "tokens_per_s": tps, "mfu": tps * flops_per_token / peak,
                   "mem_gib": mem, "lr": out["lr"], "grad_norm": out["grad_norm"], "step_time_s": dt,
                   "layout": layout}
            history.append(rec)
            if metrics is not None:
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
            if is_main and (step % ns.log_every == 0 or step == last):
                _progress(f"step {step:>{len(str(ns.steps))}}/{ns.steps}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
                          f"{tps:,.0f} tok/s{_mfu_text(rec['mfu'], device, '  ')}  mem {mem:.2f} GiB  {1e3 * dt:.0f} ms")
            if not math.isfinite(out["loss"]):
                raise TrainError(f"train: the loss is {out['loss']} at step {step}; lower --lr or use --dtype fp32")
            if ns.checkpoint_dir and ((ns.save_every and step % ns.save_every == 0) or step == last):
                run.save(step)
        finish_saves(run)  # a background save still running: the run ends once it is visible
    finally:
        if metrics is not None:
            metrics.close()
    if ns.export_hf:
        run.export(ns.export_hf)
    if not is_main:
        return None
    timed = history[1:] or history  # the first step pays for warm-up and compilation
    summary = {"steps": len(history), "first_step": start + 1, "last_step": last,
               "final_loss": history[-1]["loss"],
               "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed),
               "mfu": sum(r["mfu"] for r in timed) / len(timed),
               "mem_gib": max(r["mem_gib"] for r in history), "seconds": time.perf_counter() - t_run,
               "layout": layout}
    _progress(f"done: steps {start + 1}..{last}, final loss {summary['final_loss']:.4f}, "
              f"{summary['tokens_per_s']:,.0f} tok/s{_mfu_text(summary['mfu'], device, ', ')}, "
              f"peak mem {summary['mem_gib']:.2f} GiB, {summary['seconds']:.1f} s")
    return summary


def _mfu_text(mfu: float, device: torch.device, separator: str) -> str:
    """``separator + "mfu 41.20%"`` on a GPU; nothing elsewhere (the peak it divides by is a GPU's dense bf16
    rate, so on a CPU it would print a meaningless 0.00%)."""
    return f"{separator}mfu {100 * mfu:.2f}%" if device.type == "cuda" else ""

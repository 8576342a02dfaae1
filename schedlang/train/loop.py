"""The training loop of one rank: the layout (chosen again from the measured link under ``--layout
auto``, probed with ``--probe``), the plan block, the steps, held-out evaluation, metrics (tokens/s,
MFU, peak memory against the estimate) and the summary.

The host never waits for a step it has just queued: the loss and the gradient norm of step ``s``
are read once step ``s + 1`` is queued (or before a checkpoint), and a step's time is the time
between the ends of consecutive steps (CUDA events on a GPU), so the device runs back to back."""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from .data import open_data
from .flags import TrainError, _device_type, _fail
from .experts import load_text
from .layout import (apply_layout, choice_block, choose, estimate, hardware, measure_link, model_facts, plan_block,
                     probe_candidates)
from .resume import finish_saves
from .run import _Run
from .sinks import Sinks

#: dense bf16 peak of one H100 / H200 (SXM), the denominator of the reported MFU
PEAK_FLOPS_PER_GPU = 989e12
#: steps a --probe times each candidate layout for (the first compiles and is not counted)
PROBE_STEPS = 3


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # peak resident set, KiB on Linux
    return kib / 2**20


def _max_over_ranks(value: float, world: int, device: torch.device) -> torch.Tensor:
    buf = torch.tensor([value], device=device, dtype=torch.float64 if device.type == "cpu" else torch.float32)
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return buf


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _device(ns, rank: int, world: int) -> torch.device:
    if _device_type(ns) == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local_world > 1:  # ranks sharing the host's cores: no oversubscription
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return torch.device("cpu")


class _Clock:
    """Time between the ends of consecutive steps, without making the host wait: CUDA events on a GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.last = self._mark()

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def lap(self):
        """A mark at the end of the work queued so far, and the mark before it."""
        previous, self.last = self.last, self._mark()
        return previous, self.last

    def seconds(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

    def restart(self) -> None:
        self.last = self._mark()


def train(ns: argparse.Namespace, rank: int = 0, world: int = 1) -> Optional[Dict[str, Any]]:
    """Run the training loop on this rank (process group already initialized when ``world > 1``).

    Returns the summary on rank 0 (``None`` elsewhere).
    """
    device = _device(ns, rank, world)
    is_main = rank == 0
    facts = model_facts(ns, check_tensor_parallel=ns.layout == "auto" and world > 1)
    hw = hardware(ns, world)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # rank 0 prepared the data (the text's token cache) before joining
        if ns.layout == "auto" and ns.link_gbps is None:
            hw = hardware(ns, world, link_bytes_per_s=measure_link(device, world))
    batches, held_out = open_data(ns, facts.dims.vocab, mode="open")
    if ns.layout == "auto":
        choice = choose(ns, facts, hw, world)
        apply_layout(ns, choice.best.layout, world)
        if is_main:
            _progress(choice_block(choice))
        if ns.probe:
            apply_layout(ns, _probe(ns, rank, world, device, choice, batches), world)
    if is_main:
        _progress(plan_block(ns, facts, hw, world))
    run = _Run(ns, rank, world, device)
    run.make_mesh()
    run.build()
    resumed = run.load() if ns.resume else None
    start = resumed.step if resumed is not None else 0
    if is_main and resumed is not None and resumed.path is not None:
        # said at the default level: the step counts alone ("steps 21..40") would not tell a restart from a run
        # started with a shorter --steps, nor which checkpoint the weights came from
        saved_under = f" (saved under {resumed.saved_layout})" if resumed.saved_layout else ""
        _progress(f"schedlang train: resumed from the checkpoint of step {start}, {resumed.path}{saved_under}")
    last = ns.stop_after or ns.steps
    if start >= last:
        _fail(f"--resume: the checkpoint is at step {start}, nothing left to run up to step {last}")
    layout = run.layout()
    estimated_gib = estimate(ns, facts, hw).total_bytes / 2**30
    tokens_per_step = ns.global_batch * ns.seq
    flops_per_token = 6 * run.flops_params + 12 * run.dims.layers * run.dims.hidden * ns.seq
    peak = PEAK_FLOPS_PER_GPU * world
    sinks = Sinks(ns, is_main, resumed_at=start if ns.resume else None)
    if is_main:
        _progress(f"schedlang train: {ns.model} {ns.config} ({run.n_params / 1e6:.1f}M parameters), {layout}, "
                  f"{world} rank(s) on {device.type}, global batch {ns.global_batch} x {ns.seq} tokens, "
                  f"steps {start + 1}..{last} of {ns.steps}")
    history: List[Dict[str, Any]] = []
    pending: Optional[Dict[str, Any]] = None
    t_run = time.perf_counter()

    def resolve(item: Dict[str, Any]) -> None:
        """Read a queued step's results (waiting for that step only) and report them."""
        out, step = item["out"], item["step"]
        dt = clock.seconds(item["start"], item["end"])
        loss = float(out["loss"])
        tps = tokens_per_step / dt
        rec = {"step": step, "loss": loss, "tokens_per_s": tps, "mfu": tps * flops_per_token / peak,
               "mem_gib": float(item["mem"]), "mem_estimated_gib": estimated_gib, "lr": out["lr"],
               "grad_norm": float(out["grad_norm"]), "step_time_s": dt, "layout": layout}
        rec.update({k: out[k] for k in ("tokens_per_expert_min", "tokens_per_expert_max") if k in out})
        if item.get("eval") is not None:
            rec["eval_loss"] = float(item["eval"])
        history.append(rec)
        sinks.write(rec)
        if is_main and (step % ns.log_every == 0 or step == last or "eval_loss" in rec):
            evaluated = f"  eval loss {rec['eval_loss']:.4f}" if "eval_loss" in rec else ""
            _progress(f"step {step:>{len(str(ns.steps))}}/{ns.steps}  loss {loss:.4f}{evaluated}  lr {rec['lr']:.2e}  "
                      f"{tps:,.0f} tok/s{_mfu_text(rec['mfu'], device, '  ')}  mem {rec['mem_gib']:.2f} GiB  "
                      f"{1e3 * dt:.0f} ms{load_text(rec)}")
        if not math.isfinite(loss):
            raise TrainError(f"train: the loss is {loss} at step {step}; lower --lr or use --dtype fp32")

    clock = _Clock(device)
    try:
        for step in range(start + 1, last + 1):
            tokens = batches.batch(step)
            out = run.step(step, tokens)  # queued: nothing here waits for the device
            begin, end = clock.lap()
            item = {"step": step, "out": out, "start": begin, "end": end,
                    "mem": _max_over_ranks(_memory_gib(device), world, device)}
            evaluate = held_out is not None and ((ns.eval_every and step % ns.eval_every == 0) or step == last)
            if evaluate:
                item["eval"] = torch.stack([run.eval_loss(held_out.batch(i)) for i in range(held_out.count)]).mean()
            if pending is not None:
                resolve(pending)
            pending = item
            saving = ns.checkpoint_dir and ((ns.save_every and step % ns.save_every == 0) or step == last)
            if saving or evaluate:
                resolve(pending)  # a checkpoint holds no step with a non-finite loss
                pending = None
                if saving:
                    run.save(step)
                clock.restart()  # the save and the evaluation are not a step's time
        if pending is not None:
            resolve(pending)
            pending = None
        finish_saves(run)  # a background save still running: the run ends once it is visible
    finally:
        sinks.close(history if is_main else None)
    if ns.export_hf:
        run.export(ns.export_hf)
    if not is_main:
        return None
    timed = history[1:] or history  # the first step pays for warm-up and compilation
    summary = {"steps": len(history), "first_step": start + 1, "last_step": last,
               "final_loss": history[-1]["loss"],
               "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed),
               "mfu": sum(r["mfu"] for r in timed) / len(timed),
               "mem_gib": max(r["mem_gib"] for r in history), "mem_estimated_gib": estimated_gib,
               "seconds": time.perf_counter() - t_run, "layout": layout}
    evals = [r["eval_loss"] for r in history if "eval_loss" in r]
    if evals:
        summary["eval_loss"] = evals[-1]
    memory = (f"peak mem {summary['mem_gib']:.2f} GiB (estimated {estimated_gib:.2f} GiB, "
              f"{100 * (summary['mem_gib'] / estimated_gib - 1):+.0f}%)" if device.type == "cuda" else
              f"peak resident memory {summary['mem_gib']:.2f} GiB (the process; the tensors were estimated at "
              f"{estimated_gib:.2f} GiB)")
    _progress(f"done: steps {start + 1}..{last}, final loss {summary['final_loss']:.4f}"
              + (f", eval loss {summary['eval_loss']:.4f}" if evals else "")
              + f", {summary['tokens_per_s']:,.0f} tok/s{_mfu_text(summary['mfu'], device, ', ')}, {memory}, "
              f"{summary['seconds']:.1f} s")
    return summary


def _probe(ns, rank: int, world: int, device: torch.device, choice, batches):
    """``--probe``: time the best two layouts for a few steps each; the faster (the slowest rank's time) wins."""
    timed = []
    for layout in probe_candidates(choice):
        trial = argparse.Namespace(**copy.deepcopy(vars(ns)))
        trial.checkpoint_dir, trial.resume, trial.init_from = None, False, None
        apply_layout(trial, layout, world)
        run = _Run(trial, rank, world, device)
        run.make_mesh()
        run.build()
        seconds = []
        for step in range(1, PROBE_STEPS + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            float(run.step(step, batches.batch(step))["loss"])
            seconds.append(time.perf_counter() - t0)
        mine = sorted(seconds[1:])[len(seconds[1:]) // 2]
        slowest = float(_max_over_ranks(mine, world, device))
        timed.append((slowest, layout))
        if rank == 0:
            _progress(f"schedlang train: --probe {layout.describe()}: {1e3 * slowest:,.0f} ms/step")
        del run
        gc.collect()
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    best = min(timed, key=lambda t: t[0])[1]
    if rank == 0:
        _progress(f"schedlang train: --probe keeps {best.describe()}")
    return best


def _mfu_text(mfu: float, device: torch.device, separator: str) -> str:
    """``separator + "mfu 41.20%"`` on a GPU; nothing elsewhere (the peak it divides by is a GPU's dense bf16
    rate, so on a CPU it would print a meaningless 0.00%)."""
    return f"{separator}mfu {100 * mfu:.2f}%" if device.type == "cuda" else ""

"""Run a function on N local ranks (gloo on CPU, NCCL on GPUs) without torchrun.

Used by ``schedlang demo --world-size N`` and by the multi-process tests. Every rank
initializes a process group with a timeout, so a collective that never completes raises
instead of blocking forever; the launcher stops all ranks once one fails (after a short
grace period) or when the overall timeout passes, and raises
:class:`~schedlang.DistributedError` with the failing rank's traceback.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_module
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence

from ..errors import DistributedError

__all__ = ["run_distributed"]


def _worker(rank: int, world_size: int, backend: str, init_file: str, timeout: float, fn: Callable,
            args: Sequence[Any], results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(fn: Callable, world_size: int = 2, args: Sequence[Any] = (), backend: Optional[str] = None,
                    timeout: float = 120.0, collective_timeout: Optional[float] = None) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return the results by rank.

    ``fn`` must be importable by name (a module-level function). ``backend`` defaults to
    NCCL when there are enough GPUs, else gloo.

    Example::

        def work(rank, world):
            sch = schedlang.create_schedule(MLP())
            ...
            return loss.item()

        losses = run_distributed(work, world_size=2)
    """
    import torch

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    collective_timeout = collective_timeout or max(10.0, timeout * 0.8)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="schedlang-dist-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, backend, init_file, collective_timeout, fn,
                                                    tuple(args), results), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outcome: dict = {}
        deadline = time.monotonic() + timeout
        failed_at: Optional[float] = None
        try:
            while len(outcome) < world_size:
                now = time.monotonic()
                if now > deadline or (failed_at is not None and now > failed_at + 10.0):
                    break
                try:
                    rank, ok, value = results.get(timeout=0.2)
                except queue_module.Empty:
                    if all(not p.is_alive() for p in procs) and results.empty():
                        break
                    continue
                outcome[rank] = (ok, value)
                if not ok and failed_at is None:
                    failed_at = time.monotonic()
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
    errors = [f"rank {r} failed:\n{v}" for r, (ok, v) in sorted(outcome.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcome]
    if errors or missing:
        lines = errors
        if missing:
            lines.append(f"rank(s) {missing} did not finish within {timeout:.0f} s "
                         f"({'stopped after another rank failed' if errors else 'timed out'})")
        raise DistributedError("distributed run failed:\n" + "\n".join(lines))
    return [outcome[r][1] for r in range(world_size)]

"""Run a function on N local ranks without torchrun.

Used by ``schedlang demo --world-size N`` and by the multi-process tests. The ranks share one
process group: ``cpu:gloo,cuda:nccl`` when there is a GPU per rank (CUDA tensors use NCCL, CPU
tensors gloo), else gloo. Every rank's group has a finite timeout (``collective_timeout``,
``$SCHEDLANG_PG_TIMEOUT`` or 120 s), so a collective that never completes raises instead of
blocking forever. Once a rank fails the others get ``failure_grace`` seconds to report (they
raise on their own within seconds where schedlang's phases end in an agreement, see
:mod:`schedlang.distributed.agreement`); then every rank still running is stopped, and
:class:`~schedlang.DistributedError` names the rank that failed first and its traceback.
The whole run is bounded by ``timeout``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence

from ..errors import DistributedError, ScheduleValueError

__all__ = ["run_distributed"]


def _worker(rank: int, world_size: int, backend: str, init_file: str, timeout: float, fn: Callable,
            args: Sequence[Any], results) -> None:
    import torch
    import torch.distributed as dist

    from .groups import PG_TIMEOUT_ENV, pg_timeout

    # the groups the rank creates itself (make_mesh, new_group) get the same timeout
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), PG_TIMEOUT_ENV: repr(float(timeout))})
    try:
        if "nccl" in backend:
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=pg_timeout(timeout))
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        # destroying the groups closes this rank's connections: a peer blocked on it fails at once
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(fn: Callable, world_size: int = 2, args: Sequence[Any] = (), backend: Optional[str] = None,
                    timeout: float = 120.0, collective_timeout: Optional[float] = None,
                    failure_grace: Optional[float] = None) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return the results by rank.

    ``fn`` must be importable by name (a module-level function). ``backend`` defaults to
    ``"cpu:gloo,cuda:nccl"`` when there is a GPU per rank, else ``"gloo"``. ``timeout`` bounds the
    whole run (seconds); ``collective_timeout`` is the process groups' timeout (default: the smaller
    of ``$SCHEDLANG_PG_TIMEOUT`` (or 120 s) and 80% of ``timeout``); ``failure_grace`` is how long the
    other ranks may still run once one has failed (default: the agreement grace plus 5 s).

    Example::

        def work(rank, world):
            sch = schedlang.create_schedule(MLP())
            ...
            return loss.item()

        losses = run_distributed(work, world_size=2)
    """
    from .agreement import _grace
    from .groups import default_backend, pg_timeout

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ScheduleValueError(f"run_distributed: world_size must be a positive int, got {world_size!r}")
    if not timeout > 0:
        raise ScheduleValueError(f"run_distributed: timeout must be a positive number of seconds, got {timeout!r}")
    backend = backend or default_backend(world_size)
    if collective_timeout is None:
        collective_timeout = min(pg_timeout().total_seconds(), max(10.0, timeout * 0.8))
    collective_timeout = pg_timeout(collective_timeout).total_seconds()
    failure_grace = _grace() + 5.0 if failure_grace is None else failure_grace
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    order: List[int] = []  # ranks in the order their outcome arrived: the first failure is the likely cause
    with tempfile.TemporaryDirectory(prefix="schedlang-dist-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, backend, init_file, collective_timeout, fn,
                                                    tuple(args), results), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outcome: dict = {}
        started = time.monotonic()
        deadline = started + timeout
        failed_at: Optional[float] = None
        try:
            while len(outcome) < world_size:
                now = time.monotonic()
                if now > deadline or (failed_at is not None and now > failed_at + failure_grace):
                    break
                try:
                    rank, ok, value = results.get(timeout=0.2)
                except queue_module.Empty:
                    if all(not p.is_alive() for p in procs) and results.empty():
                        break
                    continue
                outcome[rank] = (ok, value)
                order.append(rank)
                if not ok and failed_at is None:
                    failed_at = time.monotonic()
        finally:
            _stop(procs)
        elapsed = time.monotonic() - started
    failures = [r for r in order if not outcome[r][0]]
    missing = [r for r in range(world_size) if r not in outcome]
    if not failures and not missing:
        return [outcome[r][1] for r in range(world_size)]
    lines = []
    if failures:
        first = failures[0]
        lines.append(f"rank {first} failed first ({_last_line(outcome[first][1])})")
        lines += [f"rank {r} failed:\n{outcome[r][1]}" for r in failures]
    if missing:
        exitcodes = {r: procs[r].exitcode for r in missing}
        dead = [r for r in missing if exitcodes[r] not in (None, 0, -15, -9)]
        if failures:
            why = f"stopped {failure_grace:.0f} s after rank {failures[0]} failed"
        elif dead:
            why = "exited with code " + ", ".join(f"{exitcodes[r]} (rank {r})" for r in dead) + " without a result"
        else:
            why = (f"timed out: still running after {elapsed:.0f} s (a rank blocked in a collective, or work "
                   f"longer than timeout=)")
        lines.append(f"rank(s) {missing} did not finish within {timeout:.0f} s ({why})")
    raise DistributedError(f"run_distributed: distributed run of {getattr(fn, '__name__', fn)!s} on {world_size} ranks ({backend}) "
                           "failed:\n" + "\n".join(lines))


def _last_line(trace: str) -> str:
    lines = [l for l in str(trace).strip().splitlines() if l.strip()]
    return lines[-1].strip() if lines else "no traceback"


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
    for p in procs:  # a process stuck in native code may ignore SIGTERM
        if p.is_alive():
            p.kill()
            p.join(timeout=5)

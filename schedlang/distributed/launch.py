"""Run a function on N local ranks without torchrun, or on the ranks torchrun started.

:func:`launch` is the public entry point: under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) it runs
the function in this process on its rank and gathers every rank's result; otherwise it starts
``world_size`` local ranks with :func:`run_distributed`. Either way it returns the results by rank, so
a script written with it runs unchanged as ``python script.py``, under ``torchrun`` and inside a
Sphinx-gallery build.

:func:`run_distributed` is used by ``schedlang demo --world-size N`` and the multi-process tests. The
ranks are fresh Python processes (see :mod:`schedlang.distributed.rank_process` for what each imports:
a function of the main script is found by its file) sharing one process group: ``cpu:gloo,cuda:nccl``
when there is a GPU per rank (CUDA tensors use NCCL, CPU tensors gloo), else gloo. Every rank's group
has a finite timeout (``collective_timeout``, ``$SCHEDLANG_PG_TIMEOUT`` or 120 s), so a collective that
never completes raises instead of blocking forever. What the ranks print is passed on to this process's
``sys.stdout`` / ``sys.stderr`` as it comes. Once a rank fails the others get ``failure_grace`` seconds to
report (they raise on their own within seconds where schedlang's phases end in an agreement, see
:mod:`schedlang.distributed.agreement`); a rank that exits without reporting (a crash, ``os._exit``, a
function it could not load) is noticed at once and the others get 2 s. Then every rank still running is
stopped, and :class:`~schedlang.DistributedError` names the rank that failed first, its traceback or its
exit code and the end of its stderr. The whole run is bounded by ``timeout``.
"""

from __future__ import annotations

import atexit
import codecs
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..errors import DistributedError, ScheduleValueError
from .rank_process import BOOTSTRAP, LAUNCHED_RANK_ENV, job_path, result_path

__all__ = ["launch", "run_distributed"]

_DEAD_RANK_GRACE_S = 2.0  # a rank that died reports nothing more; its peers fail soon or block until stopped
_STDERR_TAIL_LINES = 20


def launch(fn: Callable, world_size: int = 2, args: Sequence[Any] = (), backend: Optional[str] = None,
           timeout: float = 300.0) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks and return the results by rank.

    Under ``torchrun`` this process is one of the ranks: ``fn`` runs here (the default process group
    is started on first use, with ``backend`` or NCCL on GPUs and gloo on CPUs, and kept for later
    launches) and every rank gets all ranks' results. ``world_size`` must then equal torchrun's
    ``WORLD_SIZE``. Otherwise ``world_size`` local ranks are started, like :func:`run_distributed`'s
    (each call bounded by ``timeout`` seconds), and kept: the next call with the same ``world_size``
    runs on the same processes and process group, as the calls of a script under torchrun do, without
    paying for their start again. A call with another ``world_size``, a failure, or the end of this
    process stops them.

    ``fn`` must be defined at module level. It may live in the script being run (also when
    Sphinx-gallery executes it): each rank then runs only the script's imports, functions, classes and
    UPPER_CASE constants before calling ``fn``, so the script's other top-level code (the call to
    ``launch`` itself, plotting the results) runs once, in the launching process. Return plain values
    (numbers, lists, dicts, CPU tensors). Example::

        def train(rank, world, steps):
            ...
            return losses

        losses_by_rank = schedlang.launch(train, world_size=2, args=(10,))
    """
    if os.environ.get(LAUNCHED_RANK_ENV):
        raise ScheduleValueError(f"launch: {_name(fn)} was asked to start ranks from inside rank "
                                 f"{os.environ.get('RANK')} of a launch; call launch from the launching process only "
                                 "(keep the call out of the functions the ranks run)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _launch_in_torchrun(fn, world_size, args, backend)
    global _kept_ranks
    if _kept_ranks is not None and not (_kept_ranks.alive() and _kept_ranks.world == world_size
                                        and (backend is None or backend == _kept_ranks.backend)):
        _kept_ranks.close()
        _kept_ranks = None
    if _kept_ranks is None:
        _kept_ranks = _RankGroup(world_size, backend, timeout, None, caller="launch", persistent=True)
    return _kept_ranks.run(fn, args, timeout, None)


_kept_ranks: Optional["_RankGroup"] = None  # launch's ranks, kept for its next call of the same world size


@atexit.register
def _close_kept_ranks() -> None:
    if _kept_ranks is not None:
        _kept_ranks.close()


def _launch_in_torchrun(fn: Callable, world_size: int, args: Sequence[Any], backend: Optional[str]) -> List[Any]:
    import torch
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if world_size != world:
        raise ScheduleValueError(f"launch: {_name(fn)} needs world_size={world_size!r} ranks, but torchrun started "
                                 f"WORLD_SIZE={world}; run torchrun with --nproc_per_node={world_size} (or launch "
                                 f"with world_size={world})")
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        if "nccl" in backend:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        # later launches of the script share the group; it is closed once, at exit
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    value = fn(dist.get_rank(), world, *args)
    values: List[Any] = [None] * world
    dist.all_gather_object(values, value)
    return values


def run_distributed(fn: Callable, world_size: int = 2, args: Sequence[Any] = (), backend: Optional[str] = None,
                    timeout: float = 120.0, collective_timeout: Optional[float] = None,
                    failure_grace: Optional[float] = None) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return the results by rank.

    ``fn`` must be defined at module level (of an importable module, or of the main script: see
    :func:`launch`). ``backend`` defaults to ``"cpu:gloo,cuda:nccl"`` when there is a GPU per rank, else
    ``"gloo"``. ``timeout`` bounds the whole run (seconds); ``collective_timeout`` is the process groups'
    timeout (default: the smaller of ``$SCHEDLANG_PG_TIMEOUT`` (or 120 s) and 80% of ``timeout``);
    ``failure_grace`` is how long the other ranks may still run once one has failed (default: the
    agreement grace plus 5 s).

    Example::

        def work(rank, world):
            sch = schedlang.create_schedule(MLP())
            ...
            return loss.item()

        losses = run_distributed(work, world_size=2)
    """
    with _RankGroup(world_size, backend, timeout, collective_timeout, caller="run_distributed") as group:
        return group.run(fn, args, timeout, failure_grace)


class _RankGroup:
    """``world`` rank processes sharing one process group, which run one function after another (each
    rank waits for the next job file) until closed; closed as well once a job fails."""

    def __init__(self, world: int, backend: Optional[str], timeout: float, collective_timeout: Optional[float],
                 caller: str, persistent: bool = False):
        from .groups import PG_TIMEOUT_ENV, default_backend, pg_timeout

        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ScheduleValueError(f"{caller}: world_size must be a positive int, got {world!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ScheduleValueError(f"{caller}: timeout must be a positive number of seconds, got {timeout!r}")
        self.world, self.caller = world, caller
        self.backend = backend or default_backend(world)
        if collective_timeout is None:
            collective_timeout = min(pg_timeout().total_seconds(), max(10.0, timeout * 0.8))
        collective_timeout = pg_timeout(collective_timeout).total_seconds()
        self.run_dir = tempfile.mkdtemp(prefix="schedlang-dist-")
        self.jobs = 0
        self.ranks: List[_Rank] = []
        spec = {"sys_path": list(sys.path), "run_dir": self.run_dir, "init_file": os.path.join(self.run_dir, "store"),
                "backend": self.backend, "collective_timeout": collective_timeout, "persistent": persistent,
                "parent_pid": os.getpid()}
        self.spec_file = os.path.join(self.run_dir, "spec.json")
        with open(self.spec_file, "w") as f:
            json.dump(spec, f)
        self.env = {PG_TIMEOUT_ENV: repr(float(collective_timeout))}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def alive(self) -> bool:
        return bool(self.ranks) and all(rank.proc.poll() is None for rank in self.ranks)

    def run(self, fn: Callable, args: Sequence[Any], timeout: float, failure_grace: Optional[float]) -> List[Any]:
        from .agreement import _grace

        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ScheduleValueError(f"{self.caller}: timeout must be a positive number of seconds, got {timeout!r}")
        payload = _payload(fn, args, self.caller)
        failure_grace = _grace() + 5.0 if failure_grace is None else failure_grace
        job = self.jobs
        self.jobs += 1
        path = job_path(self.run_dir, job)
        with open(path + ".tmp", "wb") as f:
            f.write(payload)
        os.replace(path + ".tmp", path)  # a waiting rank sees the whole job or none of it
        if not self.ranks:
            self.ranks = [_Rank(r, self.world, self.run_dir, self.spec_file, self.env) for r in range(self.world)]
        try:
            outcome, order, grace_given, elapsed = _wait(self.ranks, job, timeout, failure_grace)
        except BaseException:
            self.close()
            raise
        for rank in self.ranks:
            rank.forward()
        failures = [r for r in order if not outcome[r][0]]
        missing = [r for r in range(self.world) if r not in outcome]
        if not failures and not missing:
            return [outcome[r][1] for r in range(self.world)]
        self.close()
        lines = []
        if failures:
            first = failures[0]
            lines.append(f"rank {first} failed first ({_last_line(outcome[first][1])})")
            lines += [f"rank {r} failed:\n{outcome[r][1]}" for r in failures]
        if missing:
            if failures:
                why = f"stopped {grace_given:.0f} s after rank {failures[0]} failed"
            else:
                why = (f"timed out: still running after {elapsed:.0f} s (a rank blocked in a collective, or work "
                       f"longer than timeout=)")
            lines.append(f"rank(s) {missing} did not finish within {timeout:.0f} s ({why})")
        raise DistributedError(f"{self.caller}: distributed run of {_name(fn)} on {self.world} ranks ({self.backend}) "
                               "failed:\n" + "\n".join(lines))

    def close(self) -> None:
        _stop(self.ranks)
        for rank in self.ranks:
            rank.forward()
            rank.close()
        self.ranks = []
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _name(fn) -> str:
    return str(getattr(fn, "__name__", fn))


def _payload(fn: Callable, args: Sequence[Any], caller: str) -> bytes:
    """What a rank needs to call ``fn``: the function (by reference, or by the file of the main script
    that defines it) and the pickled arguments; refused here, before any rank starts, if it cannot go."""
    name = _name(fn)
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise ScheduleValueError(f"{caller}: the function to run on the ranks must be defined at module level "
                                 f"(the ranks find it by name), got {qualname or fn!r}")
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(fn, "__module__", None) == "__main__" and getattr(main_spec, "name", "__main__") != "__main__":
        # the main script is a module run with ``python -m package.module``: the ranks import it by that name, so
        # its relative imports resolve (loaded as a file, it would have no package)
        how, where = "module", (main_spec.name, qualname)
    elif getattr(fn, "__module__", None) == "__main__":
        path = getattr(getattr(fn, "__code__", None), "co_filename", "") or getattr(sys.modules["__main__"], "__file__", "")
        path = os.path.abspath(path) if path else path
        if not path or not os.path.isfile(path):
            raise ScheduleValueError(f"{caller}: {name} is defined in the main script, but its file {path!r} "
                                     "is not readable, so the ranks cannot load it; define it in a file (a script or "
                                     "an importable module)")
        how, where = "file", (path, qualname)
    else:
        try:
            how, where = "pickle", pickle.dumps(fn)
        except Exception as e:
            raise ScheduleValueError(f"{caller}: {name} cannot be sent to the ranks ({type(e).__name__}: {e}); "
                                     "define it at module level of an importable module or of the script") from e
    try:
        args_blob = pickle.dumps(tuple(args))
    except Exception as e:
        raise ScheduleValueError(f"{caller}: the arguments of {name} cannot be sent to the ranks "
                                 f"({type(e).__name__}: {e}); pass plain values") from e
    return pickle.dumps((how, where, args_blob))


class _Rank:
    """One rank's process, its stdout and stderr files and how much of them has been passed on."""

    def __init__(self, rank: int, world: int, run_dir: str, spec_file: str, env: Dict[str, str]):
        self.rank = rank
        self.run_dir = run_dir
        env = dict(os.environ, **env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), PYTHONUNBUFFERED="1", **{LAUNCHED_RANK_ENV: "1"})
        self.paths = [os.path.join(run_dir, f"rank{rank}.{s}") for s in ("out", "err")]
        self.files = [open(p, "wb") for p in self.paths]
        self.readers = [open(p, "rb") for p in self.paths]
        self.decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in self.paths]
        self.proc = subprocess.Popen([sys.executable, "-c", BOOTSTRAP, spec_file], env=env, cwd=os.getcwd(),
                                     stdin=subprocess.DEVNULL, stdout=self.files[0], stderr=self.files[1])

    def result(self, job: int):
        path = result_path(self.run_dir, self.rank, job)
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            return pickle.load(f)

    def forward(self) -> None:
        """Pass on what the rank printed since the last call (to sys.stdout / sys.stderr as they are now,
        so a notebook or a Sphinx-gallery page shows it)."""
        for reader, decoder, stream in zip(self.readers, self.decoders, (sys.stdout, sys.stderr)):
            text = decoder.decode(reader.read())
            if text:
                stream.write(text)
                stream.flush()

    def stderr_tail(self) -> str:
        with open(self.paths[1], "rb") as f:
            lines = f.read().decode("utf-8", errors="replace").rstrip().splitlines()
        return "\n".join(lines[-_STDERR_TAIL_LINES:])

    def close(self) -> None:
        for f in self.files + self.readers:
            f.close()


def _wait(ranks: List[_Rank], job: int, timeout: float, failure_grace: float):
    """Collect the ranks' outcomes until all are in, one failed and the others' grace ran out, or ``timeout``."""
    outcome: Dict[int, tuple] = {}
    order: List[int] = []  # ranks in the order their outcome arrived: the first failure is the likely cause
    started = time.monotonic()
    deadline = started + timeout
    stop_at = None
    first_grace = failure_grace  # the grace the first failure gave the others
    while len(outcome) < len(ranks):
        now = time.monotonic()
        if now > deadline or (stop_at is not None and now > stop_at):
            break
        time.sleep(0.1)
        for rank in ranks:
            rank.forward()
            if rank.rank in outcome:
                continue
            exitcode = rank.proc.poll()
            result = rank.result(job)  # read after poll: a rank writes its result before it exits
            if result is None and exitcode is None:
                continue
            if result is None:
                result = (False, _exited(rank, exitcode))
                grace = _DEAD_RANK_GRACE_S
            else:
                grace = failure_grace
            outcome[rank.rank] = result
            order.append(rank.rank)
            if not result[0]:
                if stop_at is None:
                    stop_at, first_grace = time.monotonic() + grace, grace
    return outcome, order, first_grace, time.monotonic() - started


def _exited(rank: _Rank, exitcode: int) -> str:
    rank.forward()
    tail = rank.stderr_tail()
    how = f"exited with code {exitcode}" if exitcode >= 0 else f"was killed by signal {-exitcode}"
    said = f"; the end of its stderr:\n{tail}" if tail else "; it wrote nothing to stderr"
    return f"{how} before reporting a result{said}"


def _last_line(trace: str) -> str:
    text = str(trace)
    if text.startswith(("exited with code", "was killed by signal")):
        head, _, tail = text.partition("; ")
        last = [l for l in tail.splitlines() if l.strip()]
        return f"{head}: {last[-1].strip()}" if len(last) > 1 else head
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1].strip() if lines else "no traceback"


def _stop(ranks: List[_Rank]) -> None:
    for rank in ranks:
        if rank.proc.poll() is None:
            rank.proc.terminate()
    for rank in ranks:
        try:
            rank.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # a process stuck in native code may ignore SIGTERM
            rank.proc.kill()
            rank.proc.wait(timeout=5)

"""Process-group helpers: world size and rank that also work when torch.distributed is off, and the
timeout and backend of every process group schedlang creates.

A collective that one rank never joins blocks the others until the group's timeout; PyTorch's
default is 30 minutes (10 for NCCL). Every group schedlang creates uses :func:`pg_timeout`
instead: ``SCHEDLANG_PG_TIMEOUT`` seconds (default 120), or the ``timeout`` its caller passes.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Optional, Union

import torch
import torch.distributed as dist

from ..errors import ScheduleValueError

__all__ = ["is_distributed", "world_size", "rank", "group_description", "SINGLE_RANK", "SingleRankGroup",
           "PG_TIMEOUT_ENV", "DEFAULT_PG_TIMEOUT_S", "pg_timeout", "default_backend", "set_group_timeout",
           "new_group", "cuda_collectives", "default_device"]

logger = logging.getLogger("schedlang.distributed.groups")

#: environment variable holding the timeout, in seconds, of the process groups schedlang creates
PG_TIMEOUT_ENV = "SCHEDLANG_PG_TIMEOUT"
#: the timeout when neither an argument nor SCHEDLANG_PG_TIMEOUT gives one
DEFAULT_PG_TIMEOUT_S = 120.0

Seconds = Union[None, int, float, datetime.timedelta]


def pg_timeout(timeout: Seconds = None) -> datetime.timedelta:
    """The timeout of a process group: ``timeout`` (seconds or a timedelta) when given, else
    ``$SCHEDLANG_PG_TIMEOUT`` seconds, else 120 s.

    Example::

        dist.init_process_group("gloo", timeout=pg_timeout())
    """
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
        where = "timeout"
    elif timeout is not None:
        seconds, where = timeout, "timeout"
    else:
        raw = os.environ.get(PG_TIMEOUT_ENV)
        if raw is None or not raw.strip():
            return datetime.timedelta(seconds=DEFAULT_PG_TIMEOUT_S)
        where = f"${PG_TIMEOUT_ENV}"
        try:
            seconds = float(raw)
        except ValueError:
            raise ScheduleValueError(f"pg_timeout: {where}={raw!r} is not a number of seconds; set it to a positive number "
                                     f"such as 120") from None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0 or seconds != seconds:
        raise ScheduleValueError(f"pg_timeout: process-group {where} must be a positive number of seconds, got {seconds!r}")
    return datetime.timedelta(seconds=float(seconds))


def default_backend(world: int = 1) -> str:
    """The backend string for a process group of ``world`` local ranks.

    With a GPU per rank, ``"cpu:gloo,cuda:nccl"``: collectives on CUDA tensors use NCCL and
    those on CPU tensors gloo, so the same group serves both (object collectives go over gloo).
    Without enough GPUs, ``"gloo"``.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() >= world and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def set_group_timeout(group, timeout: Seconds = None) -> None:
    """Give an existing process group the timeout :func:`pg_timeout` names (no-op without one)."""
    if group is None or isinstance(group, SingleRankGroup) or not is_distributed():
        return
    value = pg_timeout(timeout)
    # public from torch 2.15, which deprecates the private one older releases have
    setter = getattr(dist, "set_timeout", None) or getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    try:
        if setter is not None:
            setter(value, group)
        elif hasattr(group, "set_timeout"):
            group.set_timeout(value)
    except Exception as e:  # a backend without a settable timeout keeps the one it was created with
        logger.debug("could not set the timeout of %s: %s", group, e)


def new_group(ranks=None, timeout: Seconds = None, backend: Optional[str] = None):
    """``torch.distributed.new_group`` with schedlang's finite timeout (every rank must call it)."""
    return dist.new_group(ranks=ranks, timeout=pg_timeout(timeout), backend=backend)


class SingleRankGroup:
    """Stands for a process group holding only this rank.

    A schedule on a device mesh without a ``tp`` dimension shards and syncs over this "group":
    every split keeps the whole tensor and every collective is the identity (they all return
    early for one rank), while ``None`` would mean the world.
    """

    def __repr__(self) -> str:
        return "SINGLE_RANK"

    def __reduce__(self):
        return "SINGLE_RANK"

    def __deepcopy__(self, memo):
        return self


SINGLE_RANK = SingleRankGroup()


def cuda_collectives() -> bool:
    """Whether the default process group, if there is one, can run collectives on CUDA tensors
    (NCCL, or a ``cpu:gloo,cuda:nccl`` pair); True when torch.distributed is not initialized."""
    if not is_distributed():
        return True
    backend = str(dist.get_backend()).lower()
    return "nccl" in backend or "cuda" in backend


def default_device() -> torch.device:
    """Where schedlang puts what it creates when no device is given: the current CUDA device when
    there is one and the process group can move CUDA tensors, else the CPU. A gloo-only group on a
    GPU machine keeps everything on the CPU: gloo cannot send CUDA memory."""
    if torch.cuda.is_available() and cuda_collectives():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group: Optional["dist.ProcessGroup"] = None) -> int:
    """Ranks in ``group`` (the world when None); 1 when torch.distributed is not initialized."""
    if isinstance(group, SingleRankGroup):
        return 1
    return dist.get_world_size(group) if is_distributed() else 1


def rank(group: Optional["dist.ProcessGroup"] = None) -> int:
    """This process's rank in ``group``; 0 when torch.distributed is not initialized."""
    if isinstance(group, SingleRankGroup):
        return 0
    return dist.get_rank(group) if is_distributed() else 0


def group_description(group: Optional["dist.ProcessGroup"] = None) -> str:
    if not is_distributed():
        return "no process group (single process)"
    if isinstance(group, SingleRankGroup):
        return "this rank alone (the mesh has no 'tp' dimension)"
    backend = dist.get_backend(group)
    return f"{backend} group of {world_size(group)} ranks"

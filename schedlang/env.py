"""Process-group setup for scripts that do not run under torchrun (Slapo's ``env.setup``)."""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

from .errors import ScheduleValueError

__all__ = ["setup"]


def setup(rank: int = 0, world_size: int = 1, backend: Optional[str] = None, timeout_s: float = 600.0) -> None:
    """Initialize torch.distributed for this process if it is not initialized yet.

    ``backend`` defaults to NCCL when CUDA is available, else gloo. Under torchrun the
    environment already names the rendezvous; otherwise a single process uses a free local
    port.

    Example::

        schedlang.env.setup(rank=0, world_size=1, backend="gloo")
    """
    if dist.is_initialized():
        return
    if not 0 <= rank < world_size:
        raise ScheduleValueError(f"env.setup: rank {rank} is not in range for world size {world_size}; valid ranks "
                                 f"are 0..{world_size - 1}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo", "mpi", "ucc"):
        raise ScheduleValueError(f"env.setup: unknown backend {backend!r}: valid backends are nccl, gloo, mpi, ucc")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    timeout = datetime.timedelta(seconds=timeout_s)
    if "MASTER_PORT" not in os.environ:
        if world_size > 1:
            raise ScheduleValueError("env.setup: several ranks need a common MASTER_PORT (set it, or launch with "
                                     "torchrun)")
        # one process needs no rendezvous: an in-process store, not a port that another process on the
        # host may take between choosing it and listening on it
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)

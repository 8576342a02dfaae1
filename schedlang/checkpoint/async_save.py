"""Checkpoints written in the background (``torch.distributed.checkpoint.async_save``) while training goes on.

``AsyncCheckpointer.save`` copies the state to host memory (the only part the caller waits for), then
a background thread writes it into the staging directory (``<path>.partial``). When the write has
finished on every rank, rank 0 commits it in that thread: the manifest, then the rename that makes
it visible (the same protocol as :func:`~schedlang.save_checkpoint`, :mod:`.commit`). So a run killed
during the write leaves only a ``.partial`` directory, never a checkpoint that looks complete.

DCP's background write runs collectives of its own (it gathers the ranks' plans and results). They
must not share a process group with the training step, whose collectives run at the same time from
the main thread: the checkpointer makes its own gloo group once (a collective call on every rank).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import time
import warnings
from typing import Any, Dict, Optional, Union

import torch
from torch import nn

from ..errors import CheckpointError
from .commit import staging_path
from .dcp import _begin_save, _commit_problem, _exception_text
from .ranks import _agree, _dist, _rank

logger = logging.getLogger("schedlang.checkpoint")


class PendingCheckpoint:
    """A checkpoint being written in the background. ``done()`` does not block; ``wait()`` returns once this
    rank's part is written (on rank 0: once the checkpoint is visible at ``path``) or raises
    :class:`~schedlang.CheckpointError` if the save failed."""

    def __init__(self, path: str, step, finished: "concurrent.futures.Future"):
        self.path, self.step = path, step
        self._finished = finished

    def done(self) -> bool:
        return self._finished.done()

    def wait(self, timeout: Optional[float] = None) -> None:
        try:
            self._finished.result(timeout)
        except concurrent.futures.TimeoutError:
            raise CheckpointError(f"save_checkpoint: the asynchronous save of {self.path!r} (step {self.step}) did "
                                  f"not finish within {timeout} s; it stays incomplete until it does: wait again, or call wait() "
                                  f"without a timeout to block until it is written") from None


class AsyncCheckpointer:
    """Saves checkpoints in the background, one at a time; collective (every rank makes one, in the same order
    as its other collective calls, and calls ``save`` and ``wait`` at the same points).

    ``timeout`` (seconds) bounds each collective of the background write, so that a rank that died
    during a save fails the others instead of leaving them waiting; ``pin_memory`` keeps one pinned
    host copy of the state between saves, which makes the copy from the GPU faster (at the cost of
    that much host memory for the run). A new save first waits for the one before it.

    Example::

        saver = AsyncCheckpointer()
        saver.save("ckpt/step-100", model, optimizer, step=100)   # returns once the state is copied
        ...                                                        # training goes on
        saver.wait()                                               # before the process exits
    """

    def __init__(self, timeout: Optional[float] = None, pin_memory: bool = False):
        dist = _dist()
        self.group = None
        if dist is not None and dist.get_world_size() > 1:
            kwargs = {"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}
            self.group = dist.new_group(backend="gloo", **kwargs)
        self.pin_memory = pin_memory
        self._writer = None
        self.pending: Optional[PendingCheckpoint] = None

    def save(self, path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
             step: Optional[int] = None, extra: Any = None,
             extra_files: Optional[Dict[str, Union[str, bytes]]] = None) -> PendingCheckpoint:
        """Start saving as :func:`~schedlang.save_checkpoint` would; returns once the state has been copied to
        host memory, so the model and the optimizer may change right away."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        save = _begin_save(path, model, optimizer, step, extra, extra_files)
        dist = _dist()
        try:
            writer = self._staging_writer(save.staging)
            with warnings.catch_warnings():  # DCP's note that it runs in one process: intended here
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                future = dcp.async_save(save.state, checkpoint_id=save.staging, storage_writer=writer,
                                        process_group=self.group, no_dist=dist is None)
        except BaseException as e:
            problem = f"save_checkpoint: cannot start the asynchronous save of {save.path!r}: {type(e).__name__}: {e}"
        else:
            problem = None
        finally:
            save.release()  # the state is a host copy now
        _agree(problem)
        finished: concurrent.futures.Future = concurrent.futures.Future()
        rank0, started = _rank() == 0, time.perf_counter()

        def written(f) -> None:
            # runs in DCP's background thread once the write finished on every rank (or failed)
            error = f.exception()
            if error is not None:
                finished.set_exception(CheckpointError(
                    f"save_checkpoint: the asynchronous save of {save.path!r} failed ({_exception_text(error)}); "
                    f"{staging_path(save.path)!r} stays incomplete and is never loaded"))
                return
            problem = _commit_problem(save.path, step, extra_files) if rank0 else None
            if problem is not None:
                finished.set_exception(CheckpointError(problem))
                return
            logger.info("saved checkpoint %s (%s) in the background in %.2f s", save.path, save.describe(),
                        time.perf_counter() - started)
            finished.set_result(None)

        future.add_done_callback(written)
        self.pending = PendingCheckpoint(save.path, step, finished)
        return self.pending

    def _staging_writer(self, staging: str):
        """DCP's file writer; with ``pin_memory`` one writer is kept, and with it its pinned host copy."""
        import torch.distributed.checkpoint as dcp

        if not self.pin_memory:
            return dcp.FileSystemWriter(staging)
        if self._writer is None:
            self._writer = dcp.FileSystemWriter(staging, cache_staged_state_dict=True)
        return self._writer

    def wait(self) -> None:
        """Wait for the save in progress, if any; raises :class:`~schedlang.CheckpointError` on every rank if it
        failed on any (collective when a save was in progress)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        problem = None
        try:
            pending.wait()
        except CheckpointError as e:
            problem = str(e)
        _agree(problem)


__all__ = ["AsyncCheckpointer", "PendingCheckpoint"]

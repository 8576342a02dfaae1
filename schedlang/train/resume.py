"""Saving and resuming so that a run survives a killed rank: the same command line (with ``--resume``) serves
the first start and every restart ``torchrun --max-restarts`` makes.

* A save is visible only once complete (``step-NNNNNNNN.partial/`` renamed by rank 0 after every rank
  wrote its shards); with ``--async-save`` it is written in the background while training goes on,
  and the rename happens when the write finishes. A run that ends waits for the save in progress.
* ``--resume`` takes the newest complete checkpoint. Every newer one is skipped with a warning that
  names its step and why (a save that was cut off, a file missing or cut short, a ``.metadata`` that
  changed, a read that failed); with no complete checkpoint the run starts fresh.
* The metrics file of a resumed run keeps the records up to the step it resumed from and drops the
  rest (steps that a restart computes again, and a last line cut short by the kill), so it reads as
  one uninterrupted run: every step once, in order.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import IO, List, NamedTuple, Optional, Tuple

from .checkpoints import _checkpoint_path, checkpoint_candidates, read_trainer_state, trainer_state_file

logger = logging.getLogger("schedlang.train")


# ------------------------------------------------------------------------------------------------ saving
def save_step(run, step: int, extra: dict) -> Path:
    """Save the run at ``step``: synchronously, or with ``--async-save`` in the background (the previous
    background save is waited for first)."""
    import schedlang
    from ..checkpoint import AsyncCheckpointer

    ns = run.ns
    path = _checkpoint_path(ns.checkpoint_dir, step)
    files = trainer_state_file({"step": step, **extra})
    if getattr(ns, "async_save", False):
        saver = getattr(run, "_async_saver", None)
        if saver is None:  # collective: every rank makes it at its first save
            saver = run._async_saver = AsyncCheckpointer(timeout=ns.timeout, pin_memory=run.device.type == "cuda")
        saver.save(str(path), run.model, run.optimizer, step=step, extra=extra, extra_files=files)
        logger.info("saving checkpoint %s in the background", path)
    else:
        schedlang.save_checkpoint(str(path), run.model, run.optimizer, step=step, extra=extra, extra_files=files)
        logger.info("saved checkpoint %s", path)
    return path


def finish_saves(run) -> None:
    """Wait for the background save in progress, if any (every rank; collective when there is one)."""
    saver = getattr(run, "_async_saver", None)
    if saver is not None:
        saver.wait()


# ------------------------------------------------------------------------------------------------ resuming
def clear_interrupted_saves(root: str) -> List[str]:
    """Tidy what saves cut off by a kill left (rank 0, before the run loads or saves anything): their staging
    directories go (they are never loaded), and a checkpoint renamed aside by a save over it that did not
    finish is put back."""
    from ..checkpoint.commit import _REPLACED_SUFFIX, STAGING_SUFFIX, recover_replaced

    base = Path(root)
    if not base.is_dir():
        return []
    for aside in sorted(base.glob(f"*{_REPLACED_SUFFIX}")):
        recover_replaced(str(aside)[:-len(_REPLACED_SUFFIX)])
    removed = []
    for leftover in sorted(base.glob(f"*{STAGING_SUFFIX}")):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover.name)
    if removed:
        logger.warning("removed %s: saves that did not finish (never loaded)", ", ".join(removed))
    return removed


def _rank0_candidates(root: str, rank: int) -> List[Tuple[Path, Optional[str]]]:
    """Rank 0's view of the checkpoints (newest first, with why each cannot be used), the same on every rank."""
    from ..checkpoint.ranks import _all_gather

    mine = [(str(p), problem) for p, problem in checkpoint_candidates(root)] if rank == 0 else None
    return [(Path(p), problem) for p, problem in _all_gather(mine)[0]]


class Resumed(NamedTuple):
    """Where a ``--resume`` run continues from: the checkpoint's step and path, and the layout it was saved
    under (step 0 and no path: there was none, the run starts fresh)."""

    step: int
    path: Optional[Path] = None
    saved_layout: Optional[str] = None


def load_newest(run) -> Resumed:
    """Load the newest complete checkpoint of ``--checkpoint-dir`` into the run; returns its step and path (step
    0: none, the run starts fresh). Damaged checkpoints are skipped, each named with why."""
    import schedlang
    from ..checkpoint import CheckpointDamagedError

    ns, rank = run.ns, run.rank
    if rank == 0:
        clear_interrupted_saves(ns.checkpoint_dir)
    for path, problem in _rank0_candidates(ns.checkpoint_dir, rank):
        if problem is None:
            state = read_trainer_state(path)
            try:
                info = schedlang.load_checkpoint(str(path), run.model, run.optimizer)
            except CheckpointDamagedError as e:  # every rank raises it: all move on together
                problem = str(e).removeprefix("load_checkpoint: ")
            else:
                for key in ("seed", "data", "global_batch", "seq", "model"):
                    if state.get(key) != getattr(ns, key) and rank == 0:
                        logger.warning("resuming a run saved with --%s %s under --%s %s: the continuation is not "
                                       "the same run", key.replace("_", "-"), state.get(key), key.replace("_", "-"),
                                       getattr(ns, key))
                step = int(info.get("step", state["step"])) if isinstance(info, dict) else int(state["step"])
                return Resumed(step, path, state.get("layout"))
        if rank == 0:
            logger.warning("--resume: skipping the checkpoint of step %d (%s): %s", int(path.name.rpartition("-")[2]),
                           path, problem)
    if rank == 0:
        logger.warning("--resume: no complete checkpoint in %s: starting from step 1", ns.checkpoint_dir)
    return Resumed(0)


# ------------------------------------------------------------------------------------------------ metrics
def open_metrics(path: str, resumed_at: Optional[int]) -> IO[str]:
    """The metrics file, open for appending one JSON line per step.

    A fresh run (``resumed_at`` None) starts it empty. A resumed run keeps the records of steps up to
    ``resumed_at``, the checkpoint's step, and drops the others: a restart computes those steps again, and
    a run killed while writing may have left its last line cut short. The file is rewritten whole (a
    new file renamed over it), so a kill during this leaves either the old file or the new one.
    """
    if resumed_at is None:
        return open(path, "w")
    kept, dropped = [], []
    if os.path.isfile(path):
        for line in Path(path).read_text().splitlines():
            try:
                record = json.loads(line)
                step = record["step"] if isinstance(record, dict) else None
            except ValueError:
                step = None
            if isinstance(step, int) and step <= resumed_at and (not kept or step > kept[-1][0]):
                kept.append((step, line))
            elif line.strip():
                dropped.append(step)
    if dropped:
        steps = sorted(s for s in dropped if isinstance(s, int))
        logger.warning("--metrics %s: dropped the records of %s, after the step the run resumes from (%d)%s", path,
                       f"steps {steps[0]}..{steps[-1]}" if steps else "no step", resumed_at,
                       "; and a line cut short" if len(steps) < len(dropped) else "")
    fresh = f"{path}.partial"
    with open(fresh, "w") as f:
        f.writelines(line + "\n" for _, line in kept)
    os.replace(fresh, path)
    return open(path, "a")


__all__ = ["Resumed", "save_step", "finish_saves", "load_newest", "open_metrics", "clear_interrupted_saves"]

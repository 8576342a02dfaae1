"""Where the trainer's checkpoints live: ``step-NNNNNNNN/`` directories, each holding the model, the optimizer
and the trainer state (``trainer.json``). A save is written as ``step-NNNNNNNN.partial/`` and renamed once
complete (:mod:`schedlang.checkpoint.commit`); resuming takes the newest complete one and names every newer
one it skips, and why."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .flags import _fail

_CKPT_PREFIX = "step-"
_TRAINER_STATE = "trainer.json"


def _checkpoint_path(root: str, step: int) -> Path:
    return Path(root) / f"{_CKPT_PREFIX}{step:08d}"


def _step_of(path: Path) -> Optional[int]:
    digits = path.name[len(_CKPT_PREFIX):]
    return int(digits) if digits.isdigit() else None


def checkpoint_dirs(root: str) -> List[Path]:
    """Every ``step-NNNNNNNN`` directory under ``root``, newest first (complete or not; never a ``.partial`` one)."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = [p for p in base.glob(f"{_CKPT_PREFIX}*") if p.is_dir() and _step_of(p) is not None]
    return sorted(found, key=_step_of, reverse=True)


def checkpoint_problem(path: Path) -> Optional[str]:
    """Why the trainer cannot resume from ``path`` (an incomplete or damaged save, an unreadable trainer state),
    or None. Cheap: ``stat`` calls and the small files, no tensor is read."""
    from ..checkpoint.dcp import checkpoint_problem as files_problem

    problem = files_problem(path)
    if problem is not None:
        return problem.removeprefix("load_checkpoint: ")
    file = Path(path) / _TRAINER_STATE
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        return f"its {_TRAINER_STATE} cannot be read ({type(e).__name__}: {e})"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return f"its {_TRAINER_STATE} holds no integer 'step'"
    return None


def checkpoint_candidates(root: str) -> List[Tuple[Path, Optional[str]]]:
    """Every checkpoint directory under ``root``, newest first, with why it cannot be resumed from (None: it can)."""
    return [(path, checkpoint_problem(path)) for path in checkpoint_dirs(root)]


def latest_checkpoint(root: str) -> Optional[Path]:
    """The newest complete checkpoint under ``root``, or None."""
    return next((path for path, problem in checkpoint_candidates(root) if problem is None), None)


def trainer_state_file(state: Dict[str, Any]) -> Dict[str, str]:
    """The trainer state as a file of the checkpoint (``save_checkpoint``'s ``extra_files``)."""
    return {_TRAINER_STATE: json.dumps(state, indent=1) + "\n"}


def read_trainer_state(path: Path) -> Dict[str, Any]:
    """The trainer state of the checkpoint ``path`` (its step, and the flags and model it was saved with)."""
    file = Path(path) / _TRAINER_STATE
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        state, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "expected a JSON object with an integer 'step'"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        _fail(f"--resume: {file} cannot be read ({why}); the checkpoint {path} is damaged: move it out of "
              "--checkpoint-dir to resume from the one before it")
    return state


def write_trainer_state(path: Path, state: Dict[str, Any]) -> None:
    """Write the trainer state, which marks the checkpoint complete, whole or not at all (a run stopped midway
    leaves no half-written file that a resume would take for a checkpoint)."""
    file = Path(path) / _TRAINER_STATE
    partial = file.with_name(file.name + ".partial")
    partial.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(partial, file)

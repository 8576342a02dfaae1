"""Where the trainer's checkpoints live: ``step-NNNNNNNN/`` directories, complete once their
trainer state is written."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Optional

from .flags import _fail

_CKPT_PREFIX = "step-"
_TRAINER_STATE = "trainer.json"


def _checkpoint_path(root: str, step: int) -> Path:
    return Path(root) / f"{_CKPT_PREFIX}{step:08d}"


def _step_of(path: Path) -> Optional[int]:
    digits = path.name[len(_CKPT_PREFIX):]
    return int(digits) if digits.isdigit() else None


def latest_checkpoint(root: str) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (one whose trainer state was written last), or None."""
    base = Path(root)
    if not base.is_dir():
        return None
    done = [p for p in base.glob(f"{_CKPT_PREFIX}*") if _step_of(p) is not None and (p / _TRAINER_STATE).is_file()]
    return max(done, key=_step_of, default=None)


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

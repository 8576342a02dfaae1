"""Where the trainer's checkpoints live: ``step-NNNNNNNN/`` directories, complete once their
trainer state is written."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

_CKPT_PREFIX = "step-"
_TRAINER_STATE = "trainer.json"


def _checkpoint_path(root: str, step: int) -> Path:
    return Path(root) / f"{_CKPT_PREFIX}{step:08d}"


def latest_checkpoint(root: str) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (one whose trainer state was written last), or None."""
    base = Path(root)
    if not base.is_dir():
        return None
    done = [p for p in base.glob(f"{_CKPT_PREFIX}*") if (p / _TRAINER_STATE).is_file()]
    return max(done, key=lambda p: int(p.name[len(_CKPT_PREFIX):]), default=None)

"""Checking an output path before the work that writes it: the folder it will be made in, and whether that
folder takes new files."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

__all__ = ["nearest_existing", "refuses_new_files"]


def nearest_existing(path: Path) -> Path:
    """``path`` itself if it exists, else its nearest ancestor that does (where missing folders would be made)."""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def refuses_new_files(folder: Path) -> Optional[str]:
    """Why a file cannot be made in ``folder`` (the OS's reason), or None when it can. A file is made and removed
    to find out: ``os.access`` says yes to root where the file system says no."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return str(e.strerror or e)
    return None

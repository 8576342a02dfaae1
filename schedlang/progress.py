"""Progress of long work (replaying a plan, verifying a big model, generating kernels, tuning).

Work that ends within ``min_seconds`` (2 s by default) shows nothing. Longer work shows a bar on
a terminal (tqdm, on stderr) and, when stderr is not a terminal (a log file, CI), plain lines: one
when it has run ``min_seconds``, then at most one every ``every_seconds``, and one when it ends.
``SCHEDLANG_PROGRESS=0`` turns both off; ``SCHEDLANG_PROGRESS=lines`` forces lines.

schedlang's debug logging follows PyTorch's logging scheme: ``TORCH_LOGS=+schedlang`` (debug) or
``TORCH_LOGS=schedlang`` (info) turns it on, as for any PyTorch component.

Example::

    with Progress("replaying the plan", total=len(plan), unit="step") as bar:
        for step in plan:
            ...
            bar.update(note=step.primitive)
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional, TextIO

__all__ = ["Progress", "register_torch_logs"]


def register_torch_logs() -> None:
    """Make ``TORCH_LOGS=+schedlang`` set the level of schedlang's loggers, as for PyTorch's own."""
    try:
        from torch._logging import _internal
    except ImportError:  # pragma: no cover - very old torch
        return
    try:
        _internal.register_log("schedlang", ["schedlang"])
    except Exception:  # pragma: no cover - the private API moved: logging still works the usual way
        return
    if "schedlang" in os.environ.get("TORCH_LOGS", ""):
        _internal._init_logs()  # torch parsed TORCH_LOGS at its import, before the name existed


class Progress:
    """A progress display for ``total`` units of work (``None``: unknown)."""

    def __init__(self, description: str, total: Optional[int] = None, unit: str = "step", min_seconds: float = 2.0,
                 every_seconds: float = 10.0, stream: Optional[TextIO] = None):
        self.description = description
        self.total = total
        self.unit = unit
        self.min_seconds = min_seconds
        self.every_seconds = every_seconds
        self.stream = stream or sys.stderr
        self.done = 0
        self.note = ""
        self._bar = None
        self._printed_at: Optional[float] = None
        mode = os.environ.get("SCHEDLANG_PROGRESS", "auto")
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self.mode = "off" if mode == "0" else "lines" if mode == "lines" or not isatty else "bar"

    def __enter__(self) -> "Progress":
        self._start = time.monotonic()
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.description, unit=self.unit, delay=self.min_seconds,
                             file=self.stream, leave=False, dynamic_ncols=True)
        return self

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        self.note = note
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n)
        elif self.mode == "lines":
            now = time.monotonic()
            due = self._printed_at is None and now - self._start >= self.min_seconds
            due = due or self._printed_at is not None and now - self._printed_at >= self.every_seconds
            if due:
                self._line(now)

    def _line(self, now: float, final: bool = False) -> None:
        count = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        note = f" ({self.note})" if self.note and not final else ""
        state = "done" if final else "…"
        print(f"schedlang: {self.description}: {count} {self.unit}s{note} {state} [{now - self._start:.1f} s]",
              file=self.stream, flush=True)
        self._printed_at = now

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "lines" and self._printed_at is not None and exc_type is None:
            self._line(time.monotonic(), final=True)
        return False

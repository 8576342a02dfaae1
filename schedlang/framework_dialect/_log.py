"""Reading throughput and memory from training logs (for the tuner)."""

from __future__ import annotations

import re
from typing import Optional, Tuple

__all__ = ["last_float"]


def last_float(text: str, pattern: str) -> Optional[float]:
    """The number captured by ``pattern``'s first group in its last match in ``text``, or None."""
    found = re.findall(pattern, text)
    if not found:
        return None
    value = found[-1]
    return float(value[0] if isinstance(value, tuple) else value)


def error_of(text: str) -> Tuple[int, str]:
    """``(code, message)``: 1 and the line for an out-of-memory error, 2 for another traceback, else 0."""
    for line in text.splitlines():
        if "out of memory" in line.lower() or "OutOfMemoryError" in line:
            return 1, line.strip()
    if "Traceback (most recent call last)" in text:
        return 2, text.strip().splitlines()[-1]
    return 0, ""

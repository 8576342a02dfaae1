"""Where the supported torch and transformers releases differ: every version check lives here.

schedlang supports torch >= :data:`MIN_TORCH` and transformers >= :data:`MIN_TRANSFORMERS` (declared in
``pyproject.toml``; CI's oldest-versions lane installs exactly these, from ``ci/constraints-oldest.txt``,
and ``tests/test_compat.py`` checks that the three agree). Code that depends on a newer release reads one
of the names below instead of comparing versions itself, so that raising the minimum is a matter of
deleting the names it makes always true.

Each name says which release brought the behaviour and what schedlang does without it.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Optional, Tuple

#: the oldest releases schedlang is tested with (and declares in pyproject.toml)
MIN_TORCH = (2, 11)
MIN_TRANSFORMERS = (5, 17)


def release(version: str) -> Tuple[int, int]:
    """``(major, minor)`` of a version string: ``"2.13.0+cpu"`` -> ``(2, 13)``, ``"2.14.0.dev20261101"`` -> ``(2, 14)``."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"cannot read a release from the version {version!r}")
    return int(match.group(1)), int(match.group(2))


def _installed(package: str) -> Optional[Tuple[int, int]]:
    try:
        return release(importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return None


#: the installed torch release, ``(major, minor)``
TORCH: Tuple[int, int] = _installed("torch") or (0, 0)
#: the installed transformers release, or None without transformers
TRANSFORMERS: Optional[Tuple[int, int]] = _installed("transformers")


def torch_at_least(major: int, minor: int) -> bool:
    return TORCH >= (major, minor)


# ------------------------------------------------------------------------------------------------ torch
# Below the minimum, and no longer checked anywhere: ``dcp.async_save(no_dist=)`` and the FSDP-based composable
# ``replicate`` (both torch 2.9; its ``mesh=`` keyword and 1-D meshes: 2.11), ``scale_grads`` of the pipelining
# schedules and ``dcp.save(no_dist=)`` (2.7), public FSDP2 and DTensor (2.6).

#: torch 2.13: compiled regions that trace a collective keep its backward all-reduce; older compilers lose it
#: and the gradients are wrong, so ``compile_layers(trace_collectives=True)`` is refused there
TRACED_COLLECTIVES_KEEP_BACKWARD = torch_at_least(2, 13)


__all__ = ["MIN_TORCH", "MIN_TRANSFORMERS", "TORCH", "TRANSFORMERS", "release", "torch_at_least",
           "TRACED_COLLECTIVES_KEEP_BACKWARD"]

"""The CUDA caching allocator's settings, as the environment names them."""

from __future__ import annotations

import os

#: the caching allocator setting the trainer runs CUDA with unless the environment names one
EXPANDABLE_SEGMENTS = "expandable_segments:True"
#: the variables torch reads its allocator settings from (the second is the older, CUDA-only name)
ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def allocator_setting() -> str:
    """The caching allocator's setting as the environment names it (``default`` where it names none)."""
    for name in ALLOCATOR_VARIABLES:
        if name in os.environ:
            return os.environ[name] or "default"
    return "default"

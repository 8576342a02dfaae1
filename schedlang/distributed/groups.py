"""Process-group helpers: world size and rank that also work when torch.distributed is off."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

__all__ = ["is_distributed", "world_size", "rank", "group_description"]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group: Optional["dist.ProcessGroup"] = None) -> int:
    """Ranks in ``group`` (the world when None); 1 when torch.distributed is not initialized."""
    return dist.get_world_size(group) if is_distributed() else 1


def rank(group: Optional["dist.ProcessGroup"] = None) -> int:
    """This process's rank in ``group``; 0 when torch.distributed is not initialized."""
    return dist.get_rank(group) if is_distributed() else 0


def group_description(group: Optional["dist.ProcessGroup"] = None) -> str:
    if not is_distributed():
        return "no process group (single process)"
    backend = dist.get_backend(group)
    return f"{backend} group of {world_size(group)} ranks"

"""Process-group helpers: world size and rank that also work when torch.distributed is off."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

__all__ = ["is_distributed", "world_size", "rank", "group_description", "SINGLE_RANK", "SingleRankGroup"]


class SingleRankGroup:
    """Stands for a process group holding only this rank.

    A schedule on a device mesh without a ``tp`` dimension shards and syncs over this "group":
    every split keeps the whole tensor and every collective is the identity (they all return
    early for one rank), while ``None`` would mean the world.
    """

    def __repr__(self) -> str:
        return "SINGLE_RANK"

    def __reduce__(self):
        return "SINGLE_RANK"

    def __deepcopy__(self, memo):
        return self


SINGLE_RANK = SingleRankGroup()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group: Optional["dist.ProcessGroup"] = None) -> int:
    """Ranks in ``group`` (the world when None); 1 when torch.distributed is not initialized."""
    if isinstance(group, SingleRankGroup):
        return 1
    return dist.get_world_size(group) if is_distributed() else 1


def rank(group: Optional["dist.ProcessGroup"] = None) -> int:
    """This process's rank in ``group``; 0 when torch.distributed is not initialized."""
    if isinstance(group, SingleRankGroup):
        return 0
    return dist.get_rank(group) if is_distributed() else 0


def group_description(group: Optional["dist.ProcessGroup"] = None) -> str:
    if not is_distributed():
        return "no process group (single process)"
    if isinstance(group, SingleRankGroup):
        return "this rank alone (the mesh has no 'tp' dimension)"
    backend = dist.get_backend(group)
    return f"{backend} group of {world_size(group)} ranks"

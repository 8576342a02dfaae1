"""Verify's cross-rank steps, each in its own function so that a caller can wrap it (every rank
must enter them, in the same order).

* :func:`broadcast_reference` / :func:`broadcast_inputs`: rank 0's weights and inputs everywhere;
* :func:`all_ranks_agree`: one boolean decided together (True only if True on every rank);
* :func:`replicated_disagreements`: tensors that must be identical on every rank, checked;
* :func:`gather_mismatches`: every rank's findings, so that all of them raise together.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import groups
from .compare import compare_tensors

__all__ = ["source_rank", "broadcast_reference", "broadcast_inputs", "all_ranks_agree", "replicated_disagreements",
           "gather_mismatches"]


def source_rank(group) -> int:
    return dist.get_global_rank(group, 0) if group is not None else 0


def broadcast_reference(model: nn.Module, group) -> None:
    """Overwrite ``model``'s parameters and buffers with rank 0's."""
    src = source_rank(group)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=src, group=group)


def broadcast_inputs(values: List[Any], group, device) -> List[Any]:
    """Rank 0's copy of each tensor in ``values`` (other values pass through)."""
    src = source_rank(group)
    out = []
    for x in values:
        if isinstance(x, torch.Tensor):
            x = x.detach().clone().to(device)
            dist.broadcast(x, src=src, group=group)
        out.append(x)
    return out


def all_ranks_agree(flag: bool, group) -> bool:
    """True only if ``flag`` is True on every rank of ``group``."""
    if groups.world_size(group) <= 1:
        return flag
    everyone: List[Any] = [None] * groups.world_size(group)
    dist.all_gather_object(everyone, bool(flag), group=group)
    return all(everyone)


def replicated_disagreements(tensors: Dict[str, torch.Tensor], group, tol_for, label: str) -> Tuple[List[str], int]:
    """Compare every tensor that must be replicated with rank 0's copy.

    Each rank passes its own ``name -> tensor``; only the names present on every rank with the
    same shape are compared. Returns (messages of this rank, number of tensors compared)."""
    world = groups.world_size(group)
    if world <= 1:
        return [], 0
    mine = {name: t.detach().cpu() for name, t in tensors.items()}
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    first = everyone[0]
    rank = groups.rank(group)
    messages, compared = [], 0
    for name, t in mine.items():
        if not all(name in other and other[name].shape == t.shape for other in everyone):
            continue
        compared += 1
        if rank == 0:
            continue
        msg = compare_tensors(f"{label}{name}", t, first[name], tol_for(t.dtype))
        if msg:
            messages.append(f"{msg} [differs from rank 0's copy, but it must be the same on every rank]")
    return messages, compared


def gather_mismatches(mismatches: List[str], group) -> List[Tuple[int, List[str]]]:
    """``[(rank, mismatches)]`` of every rank of ``group``."""
    world = groups.world_size(group)
    rank = groups.rank(group)
    if world <= 1:
        return [(rank, mismatches)]
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, (rank, mismatches), group=group)
    return gathered

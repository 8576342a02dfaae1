"""Tied weights across stages: a parameter that several stages use (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``) starts equal on every pp rank holding it and gets the summed gradient."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn


@dataclasses.dataclass
class _Tied:
    names: List[str]          # every name under which some stage holds it, in stage order
    param: Optional[nn.Parameter]  # this rank's copy, or None
    holders: List[int]        # pp ranks holding a copy, ascending


def _tied_parameters(stages: List[nn.Module], rank_of_stage: Callable[[int], int]) -> List[_Tied]:
    by_id: Dict[int, Dict[int, Tuple[str, nn.Parameter]]] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), {}).setdefault(s, (name, p))
    tied = []
    for per_stage in by_id.values():
        if len(per_stage) < 2:
            continue
        names = [per_stage[s][0] for s in sorted(per_stage)]
        holders = sorted({rank_of_stage(s) for s in per_stage})
        param = next(iter(per_stage.values()))[1]
        tied.append(_Tied(names, param, holders))
    tied.sort(key=lambda t: t.names[0])
    return tied


def _local(t: torch.Tensor) -> torch.Tensor:
    from ..dtensor_params import local_tensor

    return local_tensor(t)


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor placed like ``p`` (a DTensor with ``p``'s placement, or plain)."""
    from ..dtensor_params import is_dtensor

    if not is_dtensor(p):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _exchange(tensor: torch.Tensor, holders: List[int], me: int, group) -> List[torch.Tensor]:
    """Every holder's copy of ``tensor`` (this rank's own at its place), by point-to-point over ``group``."""
    import torch.distributed as dist

    peers = [r for r in holders if r != me]
    received = {r: torch.empty_like(tensor) for r in peers}
    ops = []
    for r in peers:
        peer = dist.get_global_rank(group, r)
        ops.append(dist.P2POp(dist.isend, tensor, peer, group))
        ops.append(dist.P2POp(dist.irecv, received[r], peer, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return [tensor if r == me else received[r] for r in holders]

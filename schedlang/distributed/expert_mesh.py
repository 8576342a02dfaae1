"""Expert parallelism carved from the data-parallel ranks: which ranks share a set of experts and which hold
the same ones, as one ``DeviceMesh``.

With ``D`` data-parallel ranks (``dp``, or ``dp x cp`` under context parallelism, HSDP's two data dimensions
counted together) and an expert-parallel degree ``ep`` dividing ``D``, data-parallel rank ``d`` is
expert-parallel rank ``d % ep`` of the group of ranks ``[d - d % ep, d - d % ep + ep)``: a group's ranks are
neighbours (the token all-to-all stays on the closest links) and together hold every expert. The ranks
``d % ep, d % ep + ep, ...`` hold the same experts: the *replicas*, over which the experts' data parallelism
(FSDP2 or DDP) runs.

:func:`expert_mesh` returns the 2-D mesh ``("ep", "ep_replicate")`` of a rank's two groups. Its order is
the order in which an expert weight is split along its expert dimension: first over ``ep`` (each rank
its slice of experts), then over ``ep_replicate`` (FSDP2's shard of that slice), so a weight's DTensor on it
with ``(Shard(0), Shard(0))`` (or ``(Shard(0), Replicate())`` under DDP) names exactly the rows a rank
holds of the full tensor: what checkpoints read and write (:func:`expert_dtensor`).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ..errors import ScheduleValueError
from .mesh import DATA_DIMS

__all__ = ["EP_DIMS", "expert_mesh", "expert_dtensor", "is_expert_mesh"]

logger = logging.getLogger("schedlang.distributed.expert_mesh")

#: the dimension names of an expert mesh, in the order a weight's expert dimension is split
EP_DIMS = ("ep", "ep_replicate")


def _data_sizes(mesh):
    names = list(mesh.mesh_dim_names)
    data = [i for i, n in enumerate(names) if n in DATA_DIMS or n == "cp"]
    return names, data


def expert_mesh(mesh, ep: int, device_type: Optional[str] = None, timeout=None):
    """The ``("ep", "ep_replicate")`` mesh of this rank (see the module docstring), carved from ``mesh``'s data
    dimensions (``dp``, or ``dp_replicate`` and ``dp_shard``, and ``cp``). Collective: every rank of ``mesh``
    calls it together. ``ep`` must divide the product of the data dimensions."""
    from torch.distributed.device_mesh import DeviceMesh

    from .groups import set_group_timeout

    names, data = _data_sizes(mesh)
    ranks = mesh.mesh
    data_ranks = 1
    for i in data:
        data_ranks *= ranks.shape[i]
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or data_ranks % ep:
        valid = ", ".join(str(d) for d in range(1, data_ranks + 1) if data_ranks % d == 0)
        raise ScheduleValueError(f"expert_mesh: ep {ep!r} must divide the {data_ranks} data-parallel rank(s) of the "
                                 f"mesh {tuple(names)}; valid: {valid}")
    others = [i for i in range(len(names)) if i not in data]
    outer = 1
    for i in others:
        outer *= ranks.shape[i]
    # data dimensions last (in the mesh's order, as the flattened data dimension numbers them), then split into
    # (replica, ep) with ep innermost and swapped so that ep comes first
    by_data = ranks.permute(*others, *data).reshape(outer, data_ranks // ep, ep).transpose(1, 2).contiguous()
    full = DeviceMesh(device_type or mesh.device_type, by_data, mesh_dim_names=("ep_outer",) + EP_DIMS)
    for i in range(full.ndim):
        set_group_timeout(full.get_group(i), timeout)
    sub = full[EP_DIMS]
    logger.info("expert mesh: ep=%d x ep_replicate=%d", ep, data_ranks // ep)
    return sub


def is_expert_mesh(value) -> bool:
    """A 2-D ``DeviceMesh`` named ``("ep", "ep_replicate")``."""
    return (hasattr(value, "mesh_dim_names") and hasattr(value, "get_group")
            and tuple(value.mesh_dim_names or ()) == EP_DIMS)


def expert_dtensor(local: torch.Tensor, mesh2d, full_shape, replica_placement=None):
    """``local`` (a rank's rows of an expert weight, or of its optimizer state) as a DTensor of the full weight
    on ``mesh2d`` (an expert mesh): split over ``ep``, then as ``replica_placement`` says over ``ep_replicate``
    (None: a copy on every replica). Shares ``local``'s storage."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements = (Shard(0), replica_placement if replica_placement is not None else Replicate())
    full_shape = torch.Size(full_shape)
    stride = torch.empty(full_shape, device="meta").stride()
    return DTensor.from_local(local, mesh2d, placements, run_check=False, shape=full_shape, stride=stride)

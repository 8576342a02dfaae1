"""Device meshes: how a schedule's ranks are laid out for pipeline, data and tensor parallelism.

A schedule made with ``create_schedule(model, mesh=mesh)`` reads the mesh's dimensions by name:

====================  ======================================================================
dimension             used by
====================  ======================================================================
``"tp"``              ``shard`` / ``sync`` (tensor and sequence parallelism); sharded
                      parameters become DTensors on this dimension at build
``"dp"``              ``fully_shard`` (FSDP2) and ``replicate`` (DDP)
``"dp_replicate"``    with ``"dp_shard"``: hybrid sharded data parallelism (HSDP): parameters
``"dp_shard"``        are sharded within ``dp_shard`` and replicated across ``dp_replicate``
``"pp"``              pipeline stages cut by ``cut_pipeline_stage``
``"cp"``              ``context_parallel``: the sequence split over these ranks; data
                      parallelism (FSDP2 / DDP) runs on the data dimensions and ``cp``
                      flattened, since each ``cp`` rank's gradient holds only its tokens'
====================  ======================================================================

Any subset of the names, in any order; a dimension may have size 1. ``group=`` (a process group)
is still accepted by ``create_schedule`` and means a 1-D tensor-parallel mesh.

Example::

    mesh = schedlang.distributed.mesh.make_mesh(dp=2, tp=2)     # 4 ranks under torchrun
    sch = schedlang.create_schedule(model, mesh=mesh)
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Tuple


from ..errors import ScheduleTypeError, ScheduleValueError
from .groups import SINGLE_RANK, default_device, is_distributed, set_group_timeout

__all__ = ["MESH_DIMS", "DATA_DIMS", "make_mesh", "check_mesh", "tp_group", "dim_size", "data_parallel_mesh",
           "pipeline_mesh", "tensor_parallel_mesh", "context_parallel_mesh", "mesh_from_group", "describe_mesh"]

logger = logging.getLogger("schedlang.distributed.mesh")

#: every dimension name a schedule understands, outermost first (the order make_mesh uses)
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "dp", "cp", "tp")
#: the names of data-parallel dimensions
DATA_DIMS = ("dp_replicate", "dp_shard", "dp")


def _default_device_type() -> str:
    return default_device().type


def make_mesh(pp: int = 1, dp: int = 1, tp: int = 1, dp_replicate: int = 1, device_type: Optional[str] = None,
              timeout=None, cp: int = 1):
    """A ``DeviceMesh`` over the world with dimensions ``("pp", "dp", "tp")`` (sizes may be 1), and
    ``"cp"`` (context parallelism) between ``dp`` and ``tp`` when ``cp > 1``.

    With ``dp_replicate > 1`` the data dimension is split in two for HSDP: ``("pp", "dp_replicate",
    "dp_shard", "tp")``, where ``dp`` is the shard size. torch.distributed must be initialized and
    the product of the sizes must be the world size. The process group of every dimension gets a
    finite timeout: ``timeout`` seconds, else ``$SCHEDLANG_PG_TIMEOUT``, else 120 s (see
    :func:`schedlang.distributed.groups.pg_timeout`).

    Example::

        mesh = make_mesh(dp=2, tp=2)   # under torchrun --nproc_per_node=4
    """
    from torch.distributed.device_mesh import init_device_mesh

    sizes = {"pp": pp, "dp": dp, "tp": tp, "dp_replicate": dp_replicate, "cp": cp}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ScheduleValueError(f"make_mesh: {name} must be a positive int, got {size!r}")
    if not is_distributed():
        raise ScheduleValueError("make_mesh: needs torch.distributed to be initialized (run under torchrun, or with "
                                 "schedlang.distributed.launch.run_distributed)")
    import torch.distributed as dist

    world = dist.get_world_size()
    total = pp * dp * cp * tp * dp_replicate
    if total != world:
        raise ScheduleValueError(
            f"make_mesh: pp={pp} x dp_replicate={dp_replicate} x dp={dp} x cp={cp} x tp={tp} = {total} ranks, but the "
            f"world has {world}; choose sizes whose product is {world}")
    if dp_replicate > 1:
        shape, names = (pp, dp_replicate, dp), ("pp", "dp_replicate", "dp_shard")
    else:
        shape, names = (pp, dp), ("pp", "dp")
    # cp sits inside the data dimensions and outside tp: tp's traffic (every layer, twice) stays on the
    # closest ranks, cp's K/V all-gather (once a layer) on the next ones
    if cp > 1:
        shape, names = shape + (cp,), names + ("cp",)
    shape, names = shape + (tp,), names + ("tp",)
    from .groups import pg_timeout

    pg_timeout(timeout)  # a bad value fails before any group is created
    mesh = init_device_mesh(device_type or _default_device_type(), shape, mesh_dim_names=names)
    # DeviceMesh creates its sub-groups with PyTorch's default timeout (30 minutes)
    for i in range(mesh.ndim):
        set_group_timeout(mesh.get_group(i), timeout)
    if cp > 1:
        # made here, while every rank builds the mesh together (flattening is a collective step)
        flat = data_parallel_mesh(mesh)
        set_group_timeout(flat.get_group(flat.ndim - 1), timeout)  # (dp_replicate, dp_shard_cp): the second
    return mesh


def check_mesh(mesh, where: str = "create_schedule") -> None:
    """Raise ScheduleTypeError / ScheduleValueError if ``mesh`` is not a DeviceMesh with known, distinct names."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise ScheduleTypeError(f"{where}: mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
                                f"{type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if not names:
        raise ScheduleValueError(f"{where}: the mesh's dimensions have no names; name them from {', '.join(MESH_DIMS)} "
                                 "(init_device_mesh(..., mesh_dim_names=('dp', 'tp')))")
    unknown = [n for n in names if n not in MESH_DIMS]
    if unknown:
        raise ScheduleValueError(f"{where}: unknown mesh dimension name(s) {', '.join(map(repr, unknown))}: valid names "
                                 f"are {', '.join(MESH_DIMS)}")
    if len(set(names)) != len(names):
        raise ScheduleValueError(f"{where}: mesh dimension names repeat: {names}; each name must appear once")
    has_dp = "dp" in names
    hybrid = [n for n in ("dp_replicate", "dp_shard") if n in names]
    if has_dp and hybrid:
        raise ScheduleValueError(f"{where}: a mesh has either 'dp' or the HSDP pair 'dp_replicate' + 'dp_shard', "
                                 f"not both (got {names})")
    if len(hybrid) == 1:
        raise ScheduleValueError(f"{where}: '{hybrid[0]}' needs its partner: HSDP meshes have both 'dp_replicate' "
                                 f"and 'dp_shard' (got {names})")


def dim_size(mesh, name: str) -> int:
    """Size of the dimension ``name`` (1 when the mesh has no such dimension, or no mesh is given)."""
    if mesh is None or name not in (mesh.mesh_dim_names or ()):
        return 1
    return mesh.size(mesh.mesh_dim_names.index(name))


def tensor_parallel_mesh(mesh):
    """The 1-D ``tp`` submesh, or None when the mesh has no ``tp`` dimension."""
    return mesh["tp"] if mesh is not None and "tp" in mesh.mesh_dim_names else None


def tp_group(mesh):
    """The process group ``shard`` / ``sync`` use: the ``tp`` dimension's, or SINGLE_RANK without one."""
    sub = tensor_parallel_mesh(mesh)
    return SINGLE_RANK if sub is None else sub.get_group()


def data_parallel_mesh(mesh):
    """The submesh data parallelism runs on: ``dp`` (1-D) or ``(dp_replicate, dp_shard)`` (2-D, HSDP); None if none.

    With a ``cp`` dimension, ``cp`` is flattened into the (innermost) data dimension: ``dp_cp`` or
    ``(dp_replicate, dp_shard_cp)``. Each ``cp`` rank's gradient covers only its tokens, so gradients are
    averaged over ``cp`` as over data-parallel ranks, and parameters are sharded over both."""
    if mesh is None:
        return None
    names = mesh.mesh_dim_names
    if "cp" in names:
        inner = "dp" if "dp" in names else "dp_shard" if "dp_shard" in names else None
        flat = mesh[inner, "cp"]._flatten(f"{inner}_cp") if inner else mesh["cp"]
        if "dp_replicate" in names:
            return mesh["dp_replicate", "dp_shard_cp"]
        return flat
    if "dp" in names:
        return mesh["dp"]
    if "dp_replicate" in names:
        return mesh["dp_replicate", "dp_shard"]
    return None


def context_parallel_mesh(mesh):
    """The 1-D ``cp`` submesh, or None."""
    return mesh["cp"] if mesh is not None and "cp" in mesh.mesh_dim_names else None


def pipeline_mesh(mesh):
    """The 1-D ``pp`` submesh, or None."""
    return mesh["pp"] if mesh is not None and "pp" in mesh.mesh_dim_names else None


def mesh_from_group(group, device_type: Optional[str] = None):
    """A 1-D ``tp`` DeviceMesh over the ranks of ``group`` (None: the world)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if group is None:
        group = dist.distributed_c10d._get_default_group()
    return DeviceMesh.from_group(group, device_type or _device_type_of(group), mesh_dim_names=("tp",))


def _device_type_of(group) -> str:
    """``cuda`` for a pure NCCL group; a mixed ``cpu:gloo,cuda:nccl`` or gloo group serves CPU tensors."""
    import torch.distributed as dist

    return "cuda" if str(dist.get_backend(group)) == "nccl" else "cpu"


def describe_mesh(mesh) -> str:
    """``"pp=1 x dp=2 x tp=2 (cpu)"``."""
    if mesh is None:
        return "no mesh"
    dims: Sequence[Tuple[str, int]] = [(n, mesh.size(i)) for i, n in enumerate(mesh.mesh_dim_names)]
    return " x ".join(f"{n}={s}" for n, s in dims) + f" ({mesh.device_type})"

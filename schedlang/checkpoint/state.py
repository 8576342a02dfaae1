"""The tensors of a built model and its optimizer as DCP reads and writes them: pipeline stages,
state dicts by original name, optimizer views, and FSDP2's strided shards of tensor-parallel shards."""

from __future__ import annotations

import itertools
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .ranks import _rank

logger = logging.getLogger("schedlang.checkpoint")

#: prefixes of the optimizer's keys in a flattened optimizer state dict
_STATE, _GROUPS = "state.", "param_groups."


def _stages(model: nn.Module) -> List[nn.Module]:
    """The modules whose state this rank holds: a pipeline's stage modules, else the model itself.

    Pipeline stage modules keep the original model's names (no prefix), so the union of their
    state dicts over all ranks is the original model's state dict.
    """
    stages = getattr(model, "stage_modules", None)
    if stages is None:
        return [model]
    return list(stages)


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def _model_state(model: nn.Module, stage_keys: Optional[list] = None) -> Dict[str, Any]:
    """The union of the stage modules' sharded state dicts (DTensors stay DTensors).

    ``stage_keys``, if given, receives each stage module's names.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    out: Dict[str, Any] = {}
    for stage in _stages(model):
        own = get_model_state_dict(stage)
        if stage_keys is not None:
            stage_keys.append(list(own))
        for key, value in own.items():
            if key in out and out[key] is not value:
                logger.warning("two stage modules on rank %d hold %r; the first one's is used", _rank(), key)
                continue
            out[key] = value
    return out


class _OptimView:
    """The optimizer state dict of a model's stage modules, under the original parameter names.

    ``get_optimizer_state_dict`` names each parameter by its path in the module it is given; for a
    pipeline with several stage modules on one rank that module is a ``ModuleList`` of them, whose
    paths start with the stage index; ``fetch`` drops it and ``store`` puts it back.
    """

    def __init__(self, model: nn.Module):
        stages = _stages(model)
        self.single = len(stages) == 1
        self.module = stages[0] if self.single else nn.ModuleList(stages)
        self._prefixed: Dict[str, str] = {}

    def _strip_key(self, key: str) -> str:
        for head in (_STATE, _GROUPS):
            if key.startswith(head):
                _, _, rest = key[len(head):].partition(".")  # drop the stage index
                return head + rest
        return key

    def fetch(self, optimizer) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        raw = get_optimizer_state_dict(self.module, optimizer, options=_options(flatten_optimizer_state_dict=True))
        if self.single:
            return dict(raw)
        out = {}
        for key, value in raw.items():
            short = self._strip_key(key)
            self._prefixed[short] = key
            out[short] = value
        return out

    def store(self, optimizer, state: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if not self.single:
            state = {self._prefixed.get(k, k): v for k, v in state.items()}
        set_optimizer_state_dict(self.module, optimizer, state, options=_options(flatten_optimizer_state_dict=True))


def _optimizer_is_empty(optimizer) -> bool:
    return optimizer is not None and not optimizer.state


def _reset_optimizer(optimizer) -> None:
    """Forget the state ``get_optimizer_state_dict`` created on an optimizer that had none.

    torch initializes missing state with one zero-learning-rate step, which leaves ``step`` at 1:
    a later real step would then use the bias correction of step 2. Dropping the state again
    leaves the optimizer exactly as it was (the parameters are unchanged by an lr=0 step).
    """
    optimizer.state.clear()
    for key in ("_schedlang_plans", "_schedlang_chunk_tables"):  # schedlang's fused optimizers cache them
        optimizer.__dict__.pop(key, None)


def _zero_step(value):
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else type(value)(0)


# ------------------------------------------------------------------------------------------------ strided shards
def _has_strided(t) -> bool:
    return _is_dtensor(t) and any(type(p).__name__ == "_StridedShard" for p in t.placements)


def _strided(t) -> bool:
    """A DTensor whose chunks DCP cannot address: a block-wise shard (a fused q|k|v tensor, rank r holding part r
    of every block: several separate runs of the global tensor, while DCP records one chunk per rank), also
    under FSDP2. FSDP2's shard of a plain ``Shard`` (``(_StridedShard(d), Shard(d))``) is one chunk that DCP
    places right."""
    if not _has_strided(t):
        return False
    p = t.placements
    plain_fsdp = (len(p) == 2 and type(p[0]).__name__ == "_StridedShard" and type(p[1]).__name__ == "Shard"
                  and p[0].dim == p[1].dim)
    return not plain_fsdp


def _gather_by_hand(t) -> torch.Tensor:
    """All-gather ``t``'s local pieces over its whole mesh and put each where its placements say
    (:func:`~schedlang.distributed.dtensor_params.placement_indices`). Pieces of uneven size are padded for the
    collective and cut back after it."""
    import torch.distributed as dist

    from ..distributed.dtensor_params import placement_indices

    mesh, shape = t.device_mesh, tuple(t.shape)
    sizes = [mesh.size(d) for d in range(mesh.ndim)]
    coords = list(itertools.product(*[range(n) for n in sizes]))
    where = {c: placement_indices(shape, t.placements, c, sizes) for c in coords}
    padded_shape = [max(len(where[c][d]) for c in coords) for d in range(len(shape))]
    local = t.to_local().detach()
    piece = local.new_zeros(padded_shape)
    piece[tuple(slice(0, n) for n in local.shape)] = local
    # innermost mesh dimension first: gathered[c_i, ..., c_last] is the piece of the rank at that coordinate
    gathered = piece
    for mesh_dim in reversed(range(mesh.ndim)):
        parts = [torch.empty_like(gathered) for _ in range(sizes[mesh_dim])]
        dist.all_gather(parts, gathered.contiguous(), group=mesh.get_group(mesh_dim))
        gathered = torch.stack(parts)
    full = local.new_empty(shape)
    for c in coords:
        index = where[c]
        held = gathered[c][tuple(slice(0, len(i)) for i in index)]
        grid = tuple(i.to(full.device).view([-1 if d == k else 1 for k in range(len(shape))])
                     for d, i in enumerate(index))
        full[grid] = held
    return full


def _global_value(t) -> torch.Tensor:
    """The DTensor's own global value (for a rank-major tensor, the re-ordered one); collective.

    Block-wise shards (a fused q|k|v weight, also under FSDP2) are gathered by hand: DTensor's own
    ``full_tensor`` refuses some of them, or names FSDP2's shard of them differently, on the torch
    versions this runs on; everything else is DTensor's."""
    if _has_strided(t) and not any(p.is_partial() for p in t.placements):
        return _gather_by_hand(t)
    return t.full_tensor()


def full_tensor(t: torch.Tensor, spec=None) -> torch.Tensor:
    """The unsharded value of ``t`` (a DTensor or a plain tensor); collective over a DTensor's mesh.

    Block-wise shards (a fused q|k|v weight: rank r holds part r of every block) are gathered here
    (:func:`_global_value`), also under FSDP2.
    A tensor split in blocks of unequal widths (Phi-3's q|k|v with fewer key/value heads) is laid out
    rank-major (:attr:`ShardSpec.rank_major`): its rows are put back in their unsharded order. A built
    model's parameters and their gradients are recognized; for another tensor shaped like such a
    parameter (its optimizer state) pass the parameter's ``spec`` (its module's ``shard_specs``).

    Example::

        w = full_tensor(model.transformer.h[0].attn.c_attn.weight)   # same on every rank
    """
    if not _is_dtensor(t):
        return t
    from ..distributed.dtensor_params import rank_major_spec, to_unsharded

    if spec is None:
        spec = rank_major_spec(t)
    elif not spec.rank_major:
        spec = None
    value = _global_value(t)
    if spec is None:
        return value
    if value.dim() <= spec.axis or value.shape[spec.axis] != spec.full_shape[spec.axis]:
        from ..errors import ShardError

        raise ShardError(f"full_tensor: a tensor of shape {tuple(value.shape)} cannot be laid out as the shard "
                         f"spec says (blocks {spec.blocks} along axis {spec.axis} of {tuple(spec.full_shape)}); "
                         "pass the spec of the parameter this tensor belongs to")
    return to_unsharded(value, spec)


def _spec_of_key(key: str, rank_major: Dict[str, Any], value):
    """The rank-major ``ShardSpec`` a state entry is laid out by: a model name, or an optimizer state entry
    (``state.<parameter name>.<state name>``) shaped like its parameter; None otherwise."""
    if not rank_major or not _is_dtensor(value):
        return None
    spec = rank_major.get(key)
    if spec is None and key.startswith(_STATE):
        spec = rank_major.get(key[len(_STATE):].rpartition(".")[0])
    if spec is None or tuple(value.shape) != tuple(spec.full_shape):
        return None
    return spec


def _to_contiguous_shards(t, spec=None):
    """``t`` (strided, see :func:`_strided`, or rank-major with ``spec``) re-laid as contiguous chunks of
    its unsharded value, one per rank (``Shard(axis)`` on every mesh dimension), as DCP addresses them."""
    from torch.distributed.tensor import DTensor, Shard

    from ..distributed.dtensor_params import local_part

    mesh = t.device_mesh
    dim = spec.axis if spec is not None else next(p.dim for p in t.placements if type(p).__name__ == "_StridedShard")
    full = full_tensor(t, spec)
    placements = [Shard(dim)] * mesh.ndim
    local = local_part(full, mesh, placements).clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _dcp_ready(state: Dict[str, Any], rank_major: Optional[Dict[str, Any]] = None, experts=None
               ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``state`` with strided and rank-major DTensors re-laid for DCP (a checkpoint holds every tensor in its
    unsharded layout, whatever layout saved it), and ``{key: (original, spec or None)}`` of those entries.

    ``rank_major``: ``{parameter name: ShardSpec}`` of the rank-major parameters (``rank_major_specs``).
    ``experts``: ``{parameter name: ExpertView}`` of expert-parallel slices (:mod:`.experts`): re-laid as
    DTensors of the full weights."""
    from .experts import expert_view_of, relay_expert_entry

    out, originals = {}, {}
    for key, value in state.items():
        view = expert_view_of(key, value, experts)
        if view is not None:
            originals[key] = (value, view)
            out[key] = relay_expert_entry(value, view)
            continue
        spec = _spec_of_key(key, rank_major, value)
        if spec is not None or _strided(value):
            originals[key] = (value, spec)
            value = _to_contiguous_shards(value, spec)
        out[key] = value
    return out, originals


def _restore_strided(state: Dict[str, Any], originals: Dict[str, Any]) -> None:
    """Put what DCP read into the contiguous chunks back in the original tensors' layouts, in place."""
    from ..distributed.dtensor_params import local_part, to_rank_major

    from .experts import ExpertView, restore_expert_entry

    for key, (like, spec) in originals.items():
        if isinstance(spec, ExpertView):
            restore_expert_entry(like, state[key])
            state[key] = like
            continue
        full = state[key].full_tensor()
        if spec is not None:
            full = to_rank_major(full, spec)
        local = local_part(full, like.device_mesh, like.placements)
        with torch.no_grad():
            # the optimizer's or the module's own tensor, updated in place
            like.to_local().copy_(local.to(like.dtype))
        state[key] = like


# ------------------------------------------------------------------------------------------------ plain local shards
def plain_shard_specs(model: nn.Module, state: Dict[str, Any]) -> Dict[str, Any]:
    """``{name: ShardSpec}`` of the entries of ``state`` (``model``'s state dict) that are plain local shards: a
    model built from a schedule without a mesh keeps its shards plain tensors, whose layout only their module's
    record knows."""
    from ..distributed.dtensor_params import named_shard_specs

    specs = named_shard_specs(_stages(model))
    return {key: specs[key] for key, value in state.items()
            if key in specs and specs[key].world_size > 1 and isinstance(value, torch.Tensor)
            and not _is_dtensor(value)}


def plain_shard_mesh(model: nn.Module, specs: Dict[str, Any], device_type: str, where: str):
    """``(mesh, problem)``: the one-dimensional ``DeviceMesh`` over the process group that ``model``'s plain local
    shards (``specs``, from :func:`plain_shard_specs`) are split over, so that they can be gathered as DTensors of
    their specs; or ``(None, why not)``. The group is the one the model's sync points run on (a schedule made
    with ``group=``), else the world."""
    import torch.distributed as dist

    from ..distributed import groups
    from ..distributed.sync_ops import SyncOp

    found = {id(m.group): m.group for stage in _stages(model) for m in stage.modules()
             if isinstance(m, SyncOp) and m.group is not None and not isinstance(m.group, groups.SingleRankGroup)}
    if len(found) > 1:
        return None, (f"{where}: the model's sync points run on {len(found)} different process groups, so which "
                      "one its plain local shards are split over is unknown; build the schedule with a mesh "
                      "(schedlang.create_schedule(model, mesh=make_mesh(tp=...)))")
    group = next(iter(found.values())) if found else dist.group.WORLD
    size, rank = groups.world_size(group), groups.rank(group)
    for key, spec in specs.items():
        if (spec.world_size, spec.rank) != (size, rank):
            return None, (f"{where}: {key!r} is a plain local shard of rank {spec.rank} of {spec.world_size}, but "
                          f"this process is rank {rank} of {size} of the process group the model syncs over; "
                          "call it on the ranks the schedule was built on")
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type), None

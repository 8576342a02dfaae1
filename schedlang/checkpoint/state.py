"""The tensors of a built model and its optimizer as DCP reads and writes them: pipeline stages,
state dicts by original name, optimizer views, and FSDP2's strided shards of tensor-parallel shards."""

from __future__ import annotations

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
def _strided(t) -> bool:
    """A DTensor on a 1-D mesh sharded block-wise (a fused q|k|v tensor): DCP cannot address it.

    Each rank holds part r of every block, i.e. several separate chunks of the global tensor,
    while DCP records one chunk per rank. On multi-dimensional meshes FSDP2 uses the same
    placement class for a contiguous chunk, which DCP does handle.
    """
    if not _is_dtensor(t) or t.device_mesh.ndim != 1:
        return False
    return type(t.placements[0]).__name__ == "_StridedShard"


def _splits(placement) -> bool:
    """Whether a placement splits a tensor dimension: ``Shard`` or the block-wise ``_StridedShard``
    (neither a ``Shard`` subclass nor ``is_shard()`` on every torch version)."""
    return placement.is_shard() or type(placement).__name__ == "_StridedShard"


def _gathered_by_hand(t) -> bool:
    """Whether :func:`full_tensor` reassembles ``t`` itself: block-wise shards on a 1-D mesh, or any
    block-wise shard on a mesh whose dimensions each split a different tensor dimension (FSDP2 rows
    of a fused q|k|v weight split by columns). DTensor's own ``full_tensor`` refuses both on some torch
    versions this runs on (2.11); shards of one tensor dimension on several mesh dimensions are left
    to DTensor, whose placement order defines them."""
    if not _is_dtensor(t) or not any(type(p).__name__ == "_StridedShard" for p in t.placements):
        return False
    shards = [(i, p) for i, p in enumerate(t.placements) if _splits(p)]
    dims = [p.dim for _, p in shards]
    # all_gather needs equal pieces: FSDP2's padded uneven shards go to DTensor
    even = all(t.shape[p.dim] % (t.device_mesh.size(i) * getattr(p, "split_factor", 1)) == 0 for i, p in shards)
    return even and len(dims) == len(set(dims)) and not any(p.is_partial() for p in t.placements)


def _fsdp_over_block_shards(t) -> bool:
    """FSDP2 rows of a tensor-parallel fused q|k|v shard on a 2-D mesh, both splitting one tensor
    dimension (torch 2.11 calls it ``(Shard(d), _StridedShard(d, sf=3))`` and cannot gather it)."""
    p = t.placements
    return (t.device_mesh.ndim == 2 and all(_splits(x) for x in p) and p[0].dim == p[1].dim
            and type(p[1]).__name__ == "_StridedShard")


def _gather(t, contiguous_outer: bool = False) -> torch.Tensor:
    """All-gather ``t``'s local pieces one mesh dimension at a time, outermost first, and put them
    back: a ``Shard`` by concatenation, a ``_StridedShard`` block by block (rank r held part r of each
    block). With ``contiguous_outer`` the outermost dimension is FSDP2's contiguous chunks of the
    inner shard, whatever its placement says."""
    import torch.distributed as dist

    mesh, local = t.device_mesh, t.to_local().contiguous()
    for mesh_dim, placement in enumerate(t.placements):
        if not _splits(placement):
            continue
        dim = placement.dim
        blocks = 1 if contiguous_outer and mesh_dim == 0 else getattr(placement, "split_factor", 1)
        parts = [torch.empty_like(local) for _ in range(mesh.size(mesh_dim))]
        dist.all_gather(parts, local, group=mesh.get_group(mesh_dim))
        pieces = [part.chunk(blocks, dim) for part in parts]  # pieces[r][b]: part r of block b
        local = torch.cat([pieces[r][b] for b in range(blocks) for r in range(len(parts))], dim).contiguous()
    return local


def _global_value(t) -> torch.Tensor:
    """The DTensor's own global value (for a rank-major tensor, the re-ordered one); collective."""
    if _gathered_by_hand(t):
        return _gather(t)
    try:
        return t.full_tensor()
    except ValueError:
        if not _fsdp_over_block_shards(t):
            raise
        return _gather(t, contiguous_outer=True)


def full_tensor(t: torch.Tensor, spec=None) -> torch.Tensor:
    """The unsharded value of ``t`` (a DTensor or a plain tensor); collective over a DTensor's mesh.

    Block-wise shards (a fused q|k|v weight: rank r holds part r of every block) are gathered here,
    one mesh dimension at a time, where DTensor's own ``full_tensor`` cannot reassemble them on every
    torch version this runs on (see :func:`_gathered_by_hand` and :func:`_fsdp_over_block_shards`).
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
    dim = spec.axis if spec is not None else t.placements[0].dim
    full = full_tensor(t, spec)
    placements = [Shard(dim)] * mesh.ndim
    local = local_part(full, mesh, placements).clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _dcp_ready(state: Dict[str, Any], rank_major: Optional[Dict[str, Any]] = None
               ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``state`` with strided and rank-major DTensors re-laid for DCP (a checkpoint holds every tensor in its
    unsharded layout, whatever layout saved it), and ``{key: (original, spec or None)}`` of those entries.

    ``rank_major``: ``{parameter name: ShardSpec}`` of the rank-major parameters (``rank_major_specs``)."""
    out, originals = {}, {}
    for key, value in state.items():
        spec = _spec_of_key(key, rank_major, value)
        if spec is not None or _strided(value):
            originals[key] = (value, spec)
            value = _to_contiguous_shards(value, spec)
        out[key] = value
    return out, originals


def _restore_strided(state: Dict[str, Any], originals: Dict[str, Any]) -> None:
    """Put what DCP read into the contiguous chunks back in the original tensors' layouts, in place."""
    from ..distributed.dtensor_params import local_part, to_rank_major

    for key, (like, spec) in originals.items():
        full = state[key].full_tensor()
        if spec is not None:
            full = to_rank_major(full, spec)
        local = local_part(full, like.device_mesh, like.placements)
        with torch.no_grad():
            # the optimizer's or the module's own tensor, updated in place
            like.to_local().copy_(local.to(like.dtype))
        state[key] = like

"""Expert-parallel slices in checkpoints: each rank holds experts ``[r*E/ep, (r+1)*E/ep)`` of a block (and,
under FSDP2, its shard of them over the ranks holding the same experts), a plain tensor or a DTensor of the
*slice*. A checkpoint holds the full tensor, so that one saved under one expert-parallel degree loads under
another: the entry is re-laid as a DTensor of the full weight on the expert mesh ``("ep", "ep_replicate")``
(:func:`schedlang.distributed.expert_mesh.expert_dtensor`), whose placements name the rows the rank holds.
The optimizer's state of such a weight (shaped like it) goes the same way."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

__all__ = ["ExpertView", "expert_views", "expert_view_of", "relay_expert_entry", "restore_expert_entry"]

_STATE = "state."


class ExpertView:
    """What re-lays one state entry: the slice's record (a ``ShardSpec`` along dim 0) and the expert mesh."""

    def __init__(self, spec, mesh2d):
        self.spec, self.mesh2d = spec, mesh2d

    @property
    def local_shape(self) -> Tuple[int, ...]:
        full = tuple(self.spec.full_shape)
        return (full[0] // self.spec.world_size,) + full[1:]


def expert_views(modules) -> Dict[str, ExpertView]:
    """``{parameter name: ExpertView}`` of every expert slice of ``modules`` (a module or a pipeline's stage
    modules) whose experts module has an expert mesh, named as in the state dicts."""
    from ..distributed.dtensor_params import WRAPPER_NAMES
    from ..distributed.expert_parallel import ExpertParallelExperts, expert_mesh_of
    from ..module_record import expert_slice_specs

    out: Dict[str, ExpertView] = {}
    for module in [modules] if isinstance(modules, nn.Module) else modules:
        for path, sub in module.named_modules():
            if not isinstance(sub, ExpertParallelExperts) or expert_mesh_of(sub) is None:
                continue
            for name, spec in expert_slice_specs(sub).items():
                parts = [p for p in f"{path}.{name}".split(".") if p and p not in WRAPPER_NAMES]
                out[".".join(parts)] = ExpertView(spec, expert_mesh_of(sub))
    return out


def expert_view_of(key: str, value, views: Optional[Dict[str, ExpertView]]) -> Optional[ExpertView]:
    """The view of a state entry: a model name, or an optimizer state entry (``state.<parameter>.<name>``) shaped
    like its parameter's slice; None otherwise."""
    if not views or not isinstance(value, torch.Tensor):
        return None
    view = views.get(key)
    if view is None and key.startswith(_STATE):
        view = views.get(key[len(_STATE):].rpartition(".")[0])
    if view is None or tuple(value.shape) != view.local_shape:
        return None
    return view


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value._local_tensor if _is_dtensor(value) else value


def relay_expert_entry(value: torch.Tensor, view: ExpertView):
    """A copy of ``value`` (a rank's slice, plain or a DTensor over its replicas) as a DTensor of the full weight
    on the expert mesh."""
    from ..distributed.expert_mesh import expert_dtensor

    if _is_dtensor(value):
        if value.device_mesh.ndim != 1:  # pragma: no cover - the trainer's experts are on their 1-D replica mesh
            from ..errors import CheckpointError

            raise CheckpointError(f"checkpoint: an expert slice on a {value.device_mesh.ndim}-D mesh cannot be "
                                  "saved; its data parallelism must run on the expert mesh's ep_replicate ranks")
        replica = value.placements[0]
    else:
        replica = None
    return expert_dtensor(_local(value).detach().clone(), view.mesh2d, view.spec.full_shape, replica)


def restore_expert_entry(target: torch.Tensor, loaded) -> None:
    """Copy what was read into the re-laid entry ``loaded`` back into the rank's own tensor ``target``."""
    with torch.no_grad():
        _local(target).copy_(loaded._local_tensor.to(_local(target).dtype))


def full_shape_view(state: Dict[str, Any], views: Optional[Dict[str, ExpertView]]) -> Dict[str, Any]:
    """``state`` with each expert entry replaced by a meta tensor of the full weight's shape (for checks of the
    checkpoint's shapes against the model's)."""
    if not views:
        return state
    out = dict(state)
    for key, value in state.items():
        view = expert_view_of(key, value, views)
        if view is not None:
            out[key] = torch.empty(tuple(view.spec.full_shape), dtype=value.dtype, device="meta")
    return out

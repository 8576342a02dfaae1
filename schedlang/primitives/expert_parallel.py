"""``expert_parallel(group=None)``: spread the experts of every mixture-of-experts block under this module
over a group of ranks.

Each MoE block whose experts transformers 5.x keeps as 3-D tensors in one module (``gate_up_proj`` /
``down_proj``, see :func:`~schedlang.distributed.shard_rules.experts.is_experts`) gets its experts module
replaced by :class:`~schedlang.distributed.expert_parallel.ExpertParallelExperts`: rank r of the group keeps
experts ``[r*E/ep, (r+1)*E/ep)``, tokens travel to the ranks holding their experts and back by all-to-all,
and the family's router, top-k, normalisation and shared experts are left as they are. The module's
docstring in :mod:`schedlang.distributed.expert_parallel` gives the gradient contract (expert weights:
the group's summed gradient; everything else: this rank's, reduced as data parallelism does).

``group`` is the expert-parallel group: None (the world), the name of a dimension of the schedule's
mesh (``"ep"``, ``"dp"``), a 1-D ``DeviceMesh``, an expert mesh ``("ep", "ep_replicate")`` (see
:mod:`schedlang.distributed.expert_mesh`: the experts spread over ``ep`` and their data parallelism on
``ep_replicate``, as the trainer's ``--ep`` does), or a process group (a process group or mesh cannot be
written to a plan's JSON; replay such a plan in the same process).

Beside tensor parallelism the experts must be whole on every tp rank: ``shard_model(sch,
sequence_parallel=True)`` keeps them so (each tp rank routes its own sequence slice, their gradients summed
over the tp ranks) and the group is then the data-parallel ranks of one tp rank (the expert mesh carves it
so); experts split along their intermediate width by tensor parallelism are refused.

Example (each rank its own batch, the experts spread over the world)::

    sch = schedlang.create_schedule(model)
    sch.expert_parallel()
"""

from __future__ import annotations

import logging
from typing import Any, List, Tuple

from torch import nn

from ..distributed import groups
from ..distributed.expert_mesh import is_expert_mesh
from ..distributed.expert_parallel import ExpertParallelExperts, attach_expert_mesh
from ..module_record import record_expert_slice, shard_specs
from ..shard_spec import ShardSpec
from ..distributed.shard_rules.experts import is_experts
from ..errors import ScheduleValueError, ShardError, UnsupportedModelError
from .base import Param, Primitive, install_in_place_of, register_primitive

logger = logging.getLogger("schedlang.primitives.expert_parallel")


def _join(path: str, sub: str) -> str:
    return f"{path}.{sub}" if path and sub else (path or sub)


def _looks_like_expert_list(module: nn.Module) -> bool:
    """An ``nn.ModuleList`` named like experts whose members are MLPs (transformers 4.x, custom models)."""
    return isinstance(module, nn.ModuleList) and len(module) > 1 and all(
        any(isinstance(m, nn.Linear) for m in member.modules()) for member in module)


def _resolve_group(sch, group: Any) -> Any:
    where = sch.path or "<root>"
    if group is None:
        return None
    if isinstance(group, str):
        mesh = sch.mesh
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ()) if mesh is not None else ()
        if group not in names:
            valid = ", ".join(repr(n) for n in names) if names else "none (the schedule was made without mesh=)"
            raise ScheduleValueError(f"{where}: expert_parallel group {group!r} is not a dimension of the schedule's "
                                     f"mesh; valid dimension names: {valid}; or pass a process group or None (the "
                                     "world)")
        return mesh[group].get_group()
    if is_expert_mesh(group):
        return group["ep"].get_group()
    if hasattr(group, "get_group") and hasattr(group, "mesh_dim_names"):  # a DeviceMesh
        if group.ndim != 1:
            raise ScheduleValueError(f"{where}: expert_parallel group is a {group.ndim}-D DeviceMesh "
                                     f"{tuple(group.mesh_dim_names or ())}; pass one dimension of it (mesh['ep']), or an expert mesh ('ep', 'ep_replicate')")
        return group.get_group()
    return group


def _blocks(sch) -> Tuple[List[Tuple[str, nn.Module]], List[str]]:
    """(path, experts module) of every block under the schedule's module, and the paths of expert lists."""
    found, lists = [], []
    for sub, module in sch.mod.named_modules():
        if isinstance(module, ExpertParallelExperts):
            continue
        if is_experts(module):
            found.append((_join(sch.path, sub), module))
        elif sub.rsplit(".", 1)[-1] == "experts" and _looks_like_expert_list(module):
            lists.append(_join(sch.path, sub))
    return found, lists


def _expert_weights(module: nn.Module) -> List[str]:
    experts = int(module._parameters["down_proj"].shape[0])
    return [n for n, p in module._parameters.items() if p is not None and p.dim() >= 2 and p.shape[0] == experts]


@register_primitive
class ExpertParallel(Primitive):
    """Spread the experts of every mixture-of-experts block under this module over ``group`` (E/ep experts
    per rank; tokens sent to their experts' ranks and back by all-to-all). See
    :mod:`schedlang.primitives.expert_parallel`.

    Example::

        sch.expert_parallel()            # the world
        sch.expert_parallel("ep")        # the mesh's 'ep' dimension
    """

    name = "expert_parallel"
    params = (
        Param("group", Any, None, "the expert-parallel group: None (the world), a mesh dimension name, a 1-D "
                                  "DeviceMesh or a process group"),
    )

    @classmethod
    def validate(cls, sch, group=None):
        where = sch.path or "<root>"
        resolved = _resolve_group(sch, group)
        ep = groups.world_size(resolved)
        found, lists = _blocks(sch)
        if lists:
            raise UnsupportedModelError(
                f"{where}: expert_parallel supports experts kept as 3-D tensors in one module (transformers 5.x); "
                f"{', '.join(lists)} is an nn.ModuleList of separate expert MLPs")
        spread = [_join(sch.path, sub) for sub, m in sch.mod.named_modules() if isinstance(m, ExpertParallelExperts)]
        if not found and spread:
            raise ScheduleValueError(f"{where}: expert_parallel: the experts under {type(sch.mod).__name__} are spread "
                                     f"already ({', '.join(spread)}); a block's experts are spread once")
        if not found:
            raise ScheduleValueError(f"{where}: expert_parallel found no mixture-of-experts block under "
                                     f"{type(sch.mod).__name__}: valid targets hold an experts module with 3-D "
                                     "gate_up_proj/down_proj tensors (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 ...)")
        for path, module in found:
            if getattr(module, "has_post_expert_norm", False) or any(
                    True for child in module.children() for _weight in child.parameters()):
                raise UnsupportedModelError(f"{path}: expert_parallel cannot spread {type(module).__name__}: a module "
                                            "with weights runs inside its experts (a norm after each expert); only "
                                            "experts of 3-D gate_up_proj/down_proj tensors alone are supported")
            split = sorted(shard_specs(module))
            if split:
                # a tp shard along the intermediate width cut again along the experts: build would initialize and
                # checkpoints would address only one of the two splits
                raise ShardError(f"{path}: expert_parallel cannot spread experts that tensor parallelism split already "
                                 f"({', '.join(split)} sharded): keep them whole on every tp rank, as "
                                 "shard_model(sch, sequence_parallel=True) does (each tp rank then routes its own "
                                 "sequence slice), or spread them without tensor parallelism")
            total = int(module._parameters["down_proj"].shape[0])
            if total % ep:
                valid = ", ".join(str(d) for d in range(1, total + 1) if total % d == 0)
                raise ShardError(f"{path}: cannot spread {total} experts over an expert-parallel group of {ep} "
                                 f"ranks: valid group sizes divide {total} ({valid})")
        return {"group": group, "_group": resolved, "_blocks": [p for p, _ in found]}

    @classmethod
    def apply(cls, sch, group=None, _group=None, _blocks=()):
        for path in _blocks:
            old = sch.root[path].mod
            new = ExpertParallelExperts.from_experts(old, _group, _expert_weights(old))
            # build initializes the full experts and keeps this rank's slice; checkpoints and export gather it
            for name, full_shape in new.expert_weight_shapes.items():
                record_expert_slice(new, name, ShardSpec(0, new.ep_size, new.ep_rank, tuple(full_shape)))
            if is_expert_mesh(group):
                attach_expert_mesh(new, group)
            install_in_place_of(sch, old, new)
            logger.info("%s: experts %d..%d of %d on expert-parallel rank %d of %d", path,
                        new.ep_rank * new.local_experts, (new.ep_rank + 1) * new.local_experts - 1, new.total_experts,
                        new.ep_rank, new.ep_size)
        return None

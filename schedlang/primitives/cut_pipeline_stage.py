"""``cut_pipeline_stage()``: a pipeline stage ends after this module.

``sch["model.layers.3"].cut_pipeline_stage()`` marks a stage boundary *after* ``model.layers.3``
(Slapo's meaning): with cuts after layers 1 and 3 of a 6-layer model, stage 0 runs the
embeddings and layers 0-1, stage 1 layers 2-3, stage 2 layers 4-5 and the head. ``n`` cuts
make ``n + 1`` stages. The step changes nothing in the module tree; the plan step is the
record, and ``schedlang.build(sch, pipeline={...})`` splits the built model there and runs
the stages with ``torch.distributed.pipelining`` on the mesh's ``pp`` dimension (see
:mod:`schedlang.distributed.pipeline`).

Checked at call time: the root cannot be cut (nothing would follow it), a module is cut
once, a cut cannot lie inside or around another cut module, and no enclosing module may run
as one opaque call (activation checkpointing, a forward replaced on the instance), because
then the data flow between its children cannot be split. That the module is called exactly
once by the model's forward, and what crosses the boundary, is checked when the model is
split at build, which then names the cut that fails.

Example::

    for i in (1, 3):
        sch[f"model.layers.{i}"].cut_pipeline_stage()
    model, opt = schedlang.build(sch, optimizer=torch.optim.AdamW,
                                 pipeline={"schedule": "1F1B", "n_microbatches": 4, "loss_fn": loss_fn})
"""

from __future__ import annotations

from ..errors import ScheduleValueError
from ..module_record import module_record
from .base import Primitive, register_primitive

__all__ = ["CutPipelineStage", "cut_paths"]


def cut_paths(plan) -> list:
    """Paths of the plan's ``cut_pipeline_stage`` steps, in plan order."""
    return [s.path for s in plan if s.primitive == CutPipelineStage.name]


def _opaque_reason(module) -> str:
    """Why ``module``'s forward cannot be traced through (``""`` when it can)."""
    if module_record(module).checkpointed:
        return "is activation-checkpointed (its forward runs as one recomputed call)"
    if "forward" in module.__dict__:
        return "has a forward set on the instance (it runs as one opaque call)"
    return ""


@register_primitive
class CutPipelineStage(Primitive):
    """End a pipeline stage after this module; ``n`` cuts make ``n + 1`` stages, split and run on
    the mesh's ``pp`` dimension by ``schedlang.build(sch, pipeline={...})`` (see
    :mod:`schedlang.primitives.cut_pipeline_stage`).

    Example::

        sch["model.layers.1"].cut_pipeline_stage()   # stage 0: embeddings, layers 0-1; stage 1: the rest
    """

    name = "cut_pipeline_stage"

    @classmethod
    def validate(cls, sch):
        path = sch.path
        if not path:
            raise ScheduleValueError(
                "<root>: cannot cut a pipeline stage after the whole model (nothing would run after it); cut after a "
                "submodule that the forward calls in sequence, e.g. sch['model.layers.3'].cut_pipeline_stage()")
        existing = cut_paths(sch.plan)
        if path in existing:
            raise ScheduleValueError(f"{path}: a pipeline stage already ends after this module; each module can be "
                                     f"cut once (cuts so far: {', '.join(existing)})")
        for other in existing:
            if path.startswith(other + "."):
                raise ScheduleValueError(
                    f"{path}: lies inside '{other}', after which a pipeline stage already ends; a stage boundary "
                    f"cannot split a module that is itself a boundary: cut after '{other}' or after '{path}', not both")
            if other.startswith(path + "."):
                raise ScheduleValueError(
                    f"{path}: contains '{other}', after which a pipeline stage already ends; a stage boundary "
                    f"cannot split a module that is itself a boundary: cut after '{other}' or after '{path}', not both")
        root = sch.root.mod
        parts = path.split(".")
        for k in range(len(parts) - 1, 0, -1):
            ancestor_path = ".".join(parts[:k])
            reason = _opaque_reason(root.get_submodule(ancestor_path))
            if reason:
                raise ScheduleValueError(
                    f"{path}: cannot end a pipeline stage here because its enclosing module '{ancestor_path}' "
                    f"{reason}, so the data flow inside it cannot be split; cut after '{ancestor_path}' itself or "
                    "after a module outside it")
        return {}

    @classmethod
    def apply(cls, sch):
        return None

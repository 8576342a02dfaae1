"""Slapo's pipeline helpers, on schedlang's pipelining (:mod:`schedlang.distributed.pipeline`).

A schedule marks stage ends with ``sch[path].cut_pipeline_stage()``; ``schedlang.build(sch,
pipeline={...})`` splits the model and runs the stages with ``torch.distributed.pipelining``.
The functions here give Slapo's view of the same split:

* :func:`generate_pipeline_partition` -> a schedule of the split model, children ``submod_0``,
  ``submod_1`` ... (one per stage, each holding the original modules at their original paths);
* :func:`analyze_tie_weights` -> parameters used in several places (or stages);
* :func:`analyze_pipeline_module` -> each stage's inputs and what it passes on;
* :func:`build_pipeline_model` -> run the stages (``target=None``: schedlang's engine).

Example::

    sch["model.layers.1"].cut_pipeline_stage()
    parts = generate_pipeline_partition(sch)
    print([type(m).__name__ for m in parts.mod.children()])
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

from torch import fx, nn

from .errors import PipelineError

__all__ = ["propagate_partition", "add_partition_notation", "analyze_pipeline_module", "analyze_tie_weights",
           "generate_pipeline_partition", "build_pipeline_model", "PipelinePartition", "cut_paths_of"]


def cut_paths_of(sch) -> List[str]:
    """The paths of the plan's ``cut_pipeline_stage`` steps, in plan order."""
    return [step.path for step in sch.plan if step.primitive == "cut_pipeline_stage"]


class PipelinePartition(nn.Module):
    """The stages of a split model as children ``submod_0 ..``; calling it runs them in a chain."""

    def __init__(self, stages: List[nn.Module]):
        super().__init__()
        for i, stage in enumerate(stages):
            self.add_module(f"submod_{i}", stage)

    def forward(self, *args):
        stages = list(self.children())
        out = args
        for i, stage in enumerate(stages):
            out = stage(*out)
            if i + 1 < len(stages) and not isinstance(out, tuple):
                out = (out,)
        return out


def generate_pipeline_partition(sch, example_inputs=None):
    """A new schedule over the model split after its ``cut_pipeline_stage`` modules; stage ``i`` is
    child ``submod_i``.

    A model traced down to the cut level (``sch.trace_until(...)``) is split the way Slapo splits
    it, level by level with ``torch.fx``'s ``split_module``: a traced module holding cuts is split
    into pieces named after their stage (``submod_k``) and those pieces are inlined in its parent's
    graph, up to the root, whose split gives the stages. Cutting ``layers.0`` of
    ``pre -> layers(0, 1) -> post`` gives ``submod_0`` = (``pre``, ``submod_0`` = (``0``)) and
    ``submod_1`` = (``submod_1`` = (``1``), ``post``). Modules that were not traced keep their type.

    A model that was not traced is split by :func:`schedlang.distributed.pipeline.split_model`
    (stage ``i`` holds the original modules at their original paths). ``example_inputs`` (shapes
    only) say what crosses the cuts there.
    """
    from .schedule import create_schedule

    cuts = cut_paths_of(sch)
    if not cuts:
        raise PipelineError(f"{sch.path or '<root>'}: generate_pipeline_partition needs cut_pipeline_stage() steps "
                            "in the schedule; none were applied")
    root = sch.root.mod
    if isinstance(root, fx.GraphModule):
        from .pipeline_split import split_traced

        parts = split_traced(root, cuts)
    else:
        from .distributed.pipeline import split_model

        parts = PipelinePartition(split_model(root, cuts, example_inputs=example_inputs))
    new = create_schedule(parts, group=sch.group)
    for i, name in enumerate(new.child):
        add_partition_notation(new[name], i)
    return new


def add_partition_notation(sch, idx: int) -> None:
    """Record that the module of ``sch`` and every module under it belong to pipeline stage ``idx``
    (``metadata["partition_idx"]``)."""
    sch.metadata["partition_idx"] = int(idx)
    for child in sch.child.values():
        add_partition_notation(child, idx)


def propagate_partition(sch, starting_stage_id: int = 0, stop_at: Optional[str] = None) -> int:
    """Give every child schedule of ``sch`` its stage id (in ``metadata["partition_idx"]``): children
    run in order and a child with a ``cut_pipeline_stage`` step ends its stage. Stops after the
    child named ``stop_at``. Returns the stage id after the last child."""
    cuts = set(cut_paths_of(sch))
    stage = starting_stage_id
    for name, child in sch.child.items():
        add_partition_notation(child, stage)
        if child.path in cuts or any(c.startswith(child.path + ".") for c in cuts):
            inner_cuts = [c for c in cuts if c.startswith(child.path + ".")]
            stage += len(inner_cuts) + (1 if child.path in cuts else 0)
        if name == stop_at:
            break
    return stage


def analyze_pipeline_module(top_mod: nn.Module) -> Tuple[Dict[int, List[str]], Dict[int, str], Dict[int, int]]:
    """For a :class:`PipelinePartition` (or any module whose children are traced stages):
    ``(stage -> its input names, stage -> child name, stage -> number of values it passes on)``."""
    arg_names: Dict[int, List[str]] = {}
    names: Dict[int, str] = {}
    liveness: Dict[int, int] = {}
    for i, (name, stage) in enumerate(top_mod.named_children()):
        if not isinstance(stage, fx.GraphModule):
            raise PipelineError(f"analyze_pipeline_module: stage {i} ({name}) is a {type(stage).__name__}, not a "
                                "traced stage; use generate_pipeline_partition to build the partition")
        names[i] = name
        arg_names[i] = [n.target for n in stage.graph.nodes if n.op == "placeholder"]
        output = next(n for n in stage.graph.nodes if n.op == "output").args[0]
        liveness[i] = len(output) if isinstance(output, (tuple, list)) else 1
    return arg_names, names, liveness


def analyze_tie_weights(top_mod: nn.Module, is_pipeline_partitioned: bool) -> Dict[nn.Parameter, Set[Tuple[str, int]]]:
    """Parameters reachable under more than one name: ``{param: {(name, stage), ...}}``.

    With ``is_pipeline_partitioned``, the children of ``top_mod`` are the stages, names are
    relative to their stage and only parameters shared by different stages count; otherwise
    every stage id is 0.
    """
    if is_pipeline_partitioned:
        places = [(i, stage) for i, (_, stage) in enumerate(top_mod.named_children())]
    else:
        places = [(0, top_mod)]
    holders: Dict[int, Tuple[nn.Parameter, Set[Tuple[str, int]]]] = {}
    for stage_id, module in places:
        for name, param in module.named_parameters(remove_duplicate=False):
            holders.setdefault(id(param), (param, set()))[1].add((name, stage_id))
    tied = {}
    for param, where in holders.values():
        stages = {s for _, s in where}
        if len(where) > 1 and (not is_pipeline_partitioned or len(stages) > 1):
            tied[param] = where
    return tied


def build_pipeline_model(sch, target: Optional[str] = None, **kwargs: Any):
    """Run the schedule's stages: ``target=None`` with schedlang's engine (``kwargs`` are
    ``schedlang.build``'s, with ``pipeline={...}``), another target with its dialect."""
    from .framework_dialect import build_with_target

    if not cut_paths_of(sch):
        raise PipelineError(f"{sch.path or '<root>'}: build_pipeline_model needs cut_pipeline_stage() steps")
    return build_with_target(sch, target, **kwargs)

"""What a report shows, gathered from a schedule as plain data (rendered by :mod:`.page`).

Every section reads the schedule's own records: the plan, the working copy of the model
against the original, the graphs kept when submodules were traced, the fused modules with
their generated source, and (when given) a :class:`~schedlang.Verify` result. Under
``torch.distributed`` the parameter and memory table has one row per rank.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..module_record import module_record
from .graph_svg import describe_graph

__all__ = ["ReportData", "collect"]


@dataclasses.dataclass
class ReportData:
    title: str
    model_class: str
    world_size: int
    plan: List[Dict[str, Any]]
    tree: List[Dict[str, Any]]
    graphs: List[Dict[str, Any]]
    kernels: List[Dict[str, Any]]
    ranks: List[Dict[str, Any]]
    verify: Optional[Dict[str, Any]]
    versions: Dict[str, str]
    #: the training plan of a decoder-only transformer (``schedlang train --dry-run``'s block), else None
    training: Optional[Dict[str, Any]] = None


def _steps_by_path(plan) -> Dict[str, List[int]]:
    out: Dict[str, List[int]] = {}
    for i, step in enumerate(plan):
        out.setdefault(step.path, []).append(i)
    return out


def _local_numel(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", None)
    return (local if local is not None else t).numel()


def _module_notes(module: nn.Module, metadata: Dict[str, Any]) -> List[str]:
    """What the schedule did to ``module``: its record (shards, syncs, checkpointing), what it is now, and
    the notes primitives left in ``sch.metadata`` at its path."""
    notes = []
    record = module_record(module)
    for name, spec in record.shards.items():
        notes.append(f"{name} split on axis {spec.axis}")
    for sync in record.syncs:
        notes.append(f"sync {sync.child}: {sync.describe()}")
    if record.checkpointed:
        notes.append("activations recomputed in backward")
    if isinstance(module, torch.fx.GraphModule):
        notes.append(f"traced: {sum(1 for _ in module.graph.nodes)} graph nodes")
    from ..lowering.fused_module import FusedSubgraph

    if isinstance(module, FusedSubgraph):
        notes.append(f"fused kernel ({module.compiler})")
    for key in ("horizontal_fuse", "replaced", "sparse_features", "overlap_communication"):
        if key in metadata:
            notes.append(f"{key.replace('_', ' ')}: {metadata[key]}")
    return notes


def _tree(sch) -> List[Dict[str, Any]]:
    state = sch._state
    original = dict(state.original.named_modules()) if state.original is not None else {}
    steps = _steps_by_path(sch.plan)
    rows = []
    for path, module in sch.mod.named_modules():
        if any(part.startswith("_schedlang_") for part in path.split(".")):
            continue
        before = original.get(path)
        rows.append({
            "path": path or "<root>",
            "depth": path.count(".") + (1 if path else 0),
            "type": type(module).__name__,
            "type_before": type(before).__name__ if before is not None else "(new)",
            "params": sum(_local_numel(p) for p in module.parameters(recurse=False)),
            "steps": steps.get(path, []),
            "notes": _module_notes(module, state.metadata.get(path, {})),
        })
    return rows


def _graphs(sch) -> List[Dict[str, Any]]:
    out = []
    for path, module in sch.mod.named_modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        before = sch._state.metadata.get(path, {}).get("graph_at_trace")
        out.append({"path": path or "<root>", "before": before,
                    "after": describe_graph(module.graph, owner=module), "code": module.code})
    return out


def _kernel_file(module) -> Optional[str]:
    latest = module.__dict__.get("_latest")
    generated = getattr(latest, "module", None) or getattr(latest, "_module", None)
    path = getattr(generated, "__file__", None)
    if path:
        return path
    try:
        return inspect.getsourcefile(type(module))
    except TypeError:  # pragma: no cover - classes without a source file
        return None


def _kernels(sch) -> List[Dict[str, Any]]:
    from ..lowering.fused_module import FusedSubgraph

    out = []
    for path, module in sch.mod.named_modules():
        if isinstance(module, FusedSubgraph):
            out.append({"path": path, "name": module.name, "compiler": module.compiler,
                        "inputs": list(module.input_names), "outputs": list(module.output_names),
                        "source": module.source, "file": _kernel_file(module)})
    return out


def _rank_row(model: nn.Module) -> Dict[str, Any]:
    from ..distributed import groups

    params = list(model.parameters())
    row = {"rank": groups.rank(None) if groups.is_distributed() else 0,
           "parameters": sum(_local_numel(p) for p in params),
           "parameter_bytes": sum(_local_numel(p) * p.element_size() for p in params),
           "buffers": sum(b.numel() * b.element_size() for b in model.buffers())}
    device = next((p.device for p in params), torch.device("cpu"))
    if device.type == "cuda":
        row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    return row


def _ranks(sch, model: Optional[nn.Module]) -> List[Dict[str, Any]]:
    from ..distributed import groups

    row = _rank_row(model if model is not None else sch.mod)
    if not groups.is_distributed():
        return [row]
    import torch.distributed as dist

    rows: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


def _verify(report) -> Optional[Dict[str, Any]]:
    if report is None:
        return None
    return {"passed": bool(getattr(report, "passed", False)), "text": str(report),
            "compared": list(getattr(report, "compared", [])), "mismatches": list(getattr(report, "mismatches", [])),
            "not_compared": list(getattr(report, "not_compared", [])),
            "warnings": list(getattr(report, "warnings", [])),
            "rows": [dict(r) if isinstance(r, dict) else dataclasses.asdict(r)
                     for r in getattr(report, "rows", []) or []]}


def _versions() -> Dict[str, str]:
    import schedlang

    versions = {"schedlang": schedlang.__version__, "torch": torch.__version__}
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return versions


def _training(sch, training: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    from .training import training_plan

    try:
        return training_plan(sch, **(training or {}))
    except Exception as e:  # an estimate is a note on the page: a model it cannot read gets none, and says why
        return {"text": f"(no estimate: {type(e).__name__}: {e})", "estimate": None}


def collect(sch, model: Optional[nn.Module] = None, verify_report=None, title: str = "",
            training: Optional[Dict[str, Any]] = None) -> ReportData:
    """Gather the report of ``sch``; ``model`` is the built model (for per-rank memory), if any.

    Under ``torch.distributed`` every rank must call it (the per-rank table is gathered). ``training`` gives the
    training plan's ``global_batch`` and ``seq`` (default: a sequence per data-parallel rank, the model's positions).
    """
    plan = [{"index": i, "primitive": s.primitive, "path": s.path or "<root>", "args": s.describe()}
            for i, s in enumerate(sch.plan)]
    return ReportData(title=title or f"Schedule of {type(sch._state.original).__name__}",
                      model_class=type(sch._state.original).__name__, world_size=sch.world_size, plan=plan,
                      tree=_tree(sch), graphs=_graphs(sch), kernels=_kernels(sch), ranks=_ranks(sch, model),
                      verify=_verify(verify_report), versions=_versions(), training=_training(sch, training))

"""Tracing a model down to its cut modules and partitioning the graph into stages: which nodes run
in which stage, which values cross each cut and how (tensor with gradient, plain value, number)."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import operator
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn

from ...errors import PipelineError, SchedlangError

logger = logging.getLogger("schedlang.distributed.pipeline")


def _enclosing_paths(cut_paths: Sequence[str]) -> List[str]:
    out = set()
    for path in cut_paths:
        parts = path.split(".")
        for k in range(1, len(parts)):
            out.add(".".join(parts[:k]))
    return sorted(out, key=lambda p: (p.count("."), p))


def _leaf_paths(model: nn.Module, enclosing: Sequence[str]) -> List[str]:
    """Children of the root and of the enclosing modules that do not enclose a cut themselves."""
    inner = set(enclosing)
    leaves = []
    for owner in [""] + list(enclosing):
        module = model.get_submodule(owner) if owner else model
        for name, _ in module.named_children():
            full = f"{owner}.{name}" if owner else name
            if full not in inner:
                leaves.append(full)
    return leaves


@contextlib.contextmanager
def _local_tensors(model: nn.Module):
    """Tensor-parallel modules hold their local shards instead of DTensors while the model is traced
    (what their forward pre-hooks do at run time), so example values can be computed."""
    from .. import dtensor_params as dp

    modules = [m for m in model.modules() if m.__dict__.get(dp.LOCAL_VIEW_ATTR) is not None]
    for m in modules:
        dp._swap_in_local(m, ())
    try:
        yield
    finally:
        for m in modules:
            dp._swap_back(m, (), None)


@contextlib.contextmanager
def _meta_as_fake(model: nn.Module, device: torch.device):
    """Inside a fake mode: the model's meta tensors (a model not yet allocated, or the stages of other pp ranks)
    stand in as fake tensors on ``device`` while the example values are computed, so that every module computes
    on one device whatever is allocated yet."""
    swapped = []
    for module in model.modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(store.items()):
                if t is None or not t.is_meta:
                    continue
                fake = torch.empty(t.shape, dtype=t.dtype, device=device)
                store[name] = nn.Parameter(fake, requires_grad=t.requires_grad) if is_param else fake
                swapped.append((store, name, t))
    try:
        yield
    finally:
        for store, name, t in swapped:
            store[name] = t


def _trace(model: nn.Module, cut_paths: Sequence[str]) -> fx.GraphModule:
    from ...graph import tracer as T

    enclosing = _enclosing_paths(cut_paths)
    leaves = _leaf_paths(model, enclosing)
    logger.debug("tracing %s through %s; leaves %s", type(model).__name__, ["<root>"] + enclosing, leaves)
    concrete_args = None
    if _context_parallel(model) is not None:
        # the first stage takes the global positions of its tokens (the root's split of the sequence runs on it
        # instead, see stages.py): traced as an input, not computed from the local length
        main = getattr(model, "main_input_name", "input_ids")
        concrete_args = {main: fx.PH, "position_ids": fx.PH}
    try:
        with _local_tensors(model):
            return T.trace_module(model, flatten=True, leaf_modules=leaves, concrete_args=concrete_args)
    except SchedlangError as e:
        raise PipelineError(f"pipeline: cannot split {type(model).__name__} into pipeline stages after {', '.join(cut_paths)}: "
                            f"its forward could not be traced down to the cut modules: {e}") from e


def _context_parallel(model: nn.Module):
    """The ``ContextParallelGroup`` the model's sequence is split over (``context_parallel``), or None."""
    return getattr(model, "_schedlang_context_parallel", None)


_UNKNOWN = object()


def _examples(gm: fx.GraphModule, model: nn.Module, example_inputs: Optional[Sequence[Any]] = None
              ) -> Dict[fx.Node, Any]:
    """Example value (fake tensors) of every node, ``_UNKNOWN`` where it cannot be computed.

    Leaf modules run their class forward on fake inputs (their children's hooks run; sync ops only
    shape their output), so that the kinds of the values crossing a cut are known: tensor or
    tuple, dtype, whether they carry a gradient.
    """
    from ...graph import tracer as T

    fake_mode = T._new_fake_mode()
    values: Dict[fx.Node, Any] = {}
    is_hf = T.is_hf_model(model)

    def ex(a):
        return fx.node.map_aggregate(a, lambda x: values.get(x, _UNKNOWN) if isinstance(x, fx.Node) else x)

    def unknown(a) -> bool:
        found = []
        fx.node.map_aggregate(a, lambda x: found.append(x) if x is _UNKNOWN else None)
        return bool(found)

    device = next((t.device for t in model.parameters() if not t.is_meta), torch.device("cpu"))
    given = {}
    if example_inputs is not None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        given = {n: fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                 for n, t in zip(placeholders, example_inputs)}
    with _local_tensors(model), T._shape_only_syncs(), fake_mode, _meta_as_fake(model, device), torch.enable_grad():
        for node in gm.graph.nodes:
            value = _UNKNOWN
            try:
                if node in given:
                    value = given[node]
                elif node.op == "placeholder":
                    if is_hf and node.target in ("input_ids",):
                        value = torch.zeros(T.EXAMPLE_BATCH, T.EXAMPLE_SEQUENCE, dtype=torch.long, device=device)
                    elif is_hf and node.target == "position_ids":
                        value = torch.arange(T.EXAMPLE_SEQUENCE, device=device).expand(T.EXAMPLE_BATCH, -1)
                elif node.op == "get_attr":
                    value = _lookup(gm, node.target)
                elif node.op != "output":
                    args, kwargs = ex(node.args), ex(node.kwargs)
                    if not unknown((args, kwargs)):
                        if node.op == "call_module":
                            m = gm.get_submodule(node.target)
                            value = type(m).forward(m, *args, **kwargs)
                        elif node.op == "call_function":
                            value = node.target(*args, **kwargs)
                        else:
                            value = getattr(args[0], node.target)(*args[1:], **kwargs)
            except Exception as e:  # an example is a help, not a requirement: the run-time checks stay
                logger.debug("no example value for %s: %s", node.name, e)
                value = _UNKNOWN
            values[node] = value
    return values


def _lookup(root: Any, target: str) -> Any:
    return operator.attrgetter(target)(root)


# ------------------------------------------------------------------------------------------------ partition
@dataclasses.dataclass
class _Leaf:
    kind: str  # "grad" (float activation), "plain" (tensor or None without gradient), "number"
    info: Any = None  # dtype for "plain", python type name for "number"


def _structure(example: Any, where: str):
    """How a value crosses a cut: a _Leaf, ("seq", type, [children]) or ("const", value)."""
    if example is _UNKNOWN:
        return _Leaf("grad")  # checked at run time
    if isinstance(example, torch.Tensor):
        if example.is_floating_point() and example.requires_grad:
            return _Leaf("grad")
        return _Leaf("plain", example.dtype)
    if example is None:
        return ("const", None)
    if isinstance(example, bool):
        return _Leaf("number", "bool")
    if isinstance(example, int):
        return _Leaf("number", "int")
    if isinstance(example, float):
        return _Leaf("number", "float")
    if isinstance(example, (tuple, list)) and type(example) in (tuple, list, torch.Size):
        return ("seq", type(example), [_structure(e, f"{where}[{i}]") for i, e in enumerate(example)])
    raise PipelineError(f"pipeline: {where} is a {type(example).__name__}; only tensors, tuples or lists of tensors, None and "
                        "Python numbers can cross a pipeline stage boundary: move the cut")


def _leaves_of(structure) -> List[_Leaf]:
    if isinstance(structure, _Leaf):
        return [structure]
    if structure[0] == "seq":
        return [leaf for child in structure[2] for leaf in _leaves_of(child)]
    return []


@dataclasses.dataclass
class _Split:
    gm: fx.GraphModule
    order: List[fx.Node]                # computing nodes (no get_attr), in execution order
    stage_of: Dict[fx.Node, int]
    live: List[List[fx.Node]]           # live[b]: values that cross boundary b (after stage b)
    structure: Dict[fx.Node, Any]
    output: fx.Node
    inputs: List[fx.Node]
    cut_nodes: List[fx.Node]
    n_stages: int


def _model_output(gm: fx.GraphModule, values) -> fx.Node:
    """The node of the tensor the last stage returns (``.logits`` of an HF output)."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    value = out_node.args[0]
    for _ in range(4):
        if isinstance(value, fx.Node) and value.op == "call_function" and isinstance(value.target, type) and \
                not issubclass(value.target, torch.Tensor):
            fields = value.kwargs
            key = next((k for k in ("logits", "last_hidden_state", "prediction_logits") if
                        isinstance(fields.get(k), fx.Node)), None)
            if key is None:
                key = next((k for k, v in fields.items() if isinstance(v, fx.Node)), None)
            if key is None:
                break
            value = fields[key]
            continue
        if isinstance(value, (tuple, list)) and value:
            value = value[0]
            continue
        if isinstance(value, dict) and value:
            value = value.get("logits", next(iter(value.values())))
            continue
        break
    if not isinstance(value, fx.Node):
        raise PipelineError(f"pipeline: the output of {type(gm).__name__} holds no tensor the last pipeline stage could return "
                            f"(got {value!r}); the model must return a tensor (the logits)")
    example = values.get(value, _UNKNOWN)
    if example is not _UNKNOWN and not isinstance(example, torch.Tensor):
        raise PipelineError(f"pipeline: the model output '{value.name}' is a {type(example).__name__}, not a tensor; the last "
                            "pipeline stage must return one tensor (the logits)")
    return value


def _partition(model: nn.Module, cut_paths: Sequence[str], example_inputs=None) -> _Split:
    gm = _trace(model, cut_paths)
    values = _examples(gm, model, example_inputs)
    graph = gm.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    result = _model_output(gm, values)
    out_node.args = (result,)
    graph.eliminate_dead_code()
    input_names = set(getattr(gm, "_schedlang_input_names", ()) or ())
    inputs = []
    for node in list(graph.nodes):
        if node.op != "placeholder":
            continue
        if node.target in input_names or (not input_names and not node.args):
            inputs.append(node)
        elif not node.users:
            graph.erase_node(node)
        else:  # a specialized argument still read: its traced default
            node.replace_all_uses_with(node.args[0] if node.args else None)
            graph.erase_node(node)
    order = [n for n in graph.nodes if n.op not in ("get_attr", "output")]
    position = {n: i for i, n in enumerate(order)}

    cut_nodes = []
    for path in cut_paths:
        calls = [n for n in order if n.op == "call_module" and n.target == path]
        if not calls:
            raise PipelineError(
                f"{path}: cannot end a pipeline stage here: the model's forward does not call this module as one "
                f"step of its data flow (it is never called, or only inside another module); cut after a module the "
                f"forward of {type(model).__name__} (or of a module enclosing the cut) calls directly")
        if len(calls) > 1:
            raise PipelineError(f"{path}: cannot end a pipeline stage here: the forward calls this module "
                                f"{len(calls)} times, so no single point of the data flow is 'after' it; cut after a "
                                "module that runs once")
        cut_nodes.append(calls[0])
    cut_nodes.sort(key=position.__getitem__)
    cut_positions = [position[n] for n in cut_nodes]
    n_stages = len(cut_nodes) + 1
    stage_of = {n: bisect.bisect_left(cut_positions, position[n]) for n in order}
    if stage_of[result] < n_stages - 1:
        raise PipelineError(f"{cut_nodes[-1].target}: nothing runs after this module (the model output is computed "
                            f"before it), so the last pipeline stage would be empty; remove this cut")
    for s in range(1, n_stages - 1):
        if not any(stage_of[n] == s and n.op in ("call_module", "call_function", "call_method") for n in order):
            raise PipelineError(f"{cut_nodes[s].target}: nothing runs between the cut after "
                                f"'{cut_nodes[s - 1].target}' and this one, so that stage would be empty; remove one")

    last_use: Dict[fx.Node, int] = {}
    for n in order:
        users = [stage_of[u] if u.op != "output" else n_stages - 1 for u in n.users]
        last_use[n] = max(users, default=stage_of[n])
    live = [[n for n in order if stage_of[n] <= b < last_use[n]] for b in range(n_stages - 1)]
    structure = {}
    for b, crossing in enumerate(live):
        for n in crossing:
            if n not in structure:
                where = f"the value '{n.name}' (computed by {_describe(n)}), used after the cut after " \
                        f"'{cut_nodes[b].target}',"
                structure[n] = _structure(values.get(n, _UNKNOWN), where)
    for b, crossing in enumerate(live):
        if not any(_leaves_of(structure[n]) for n in crossing):
            raise PipelineError(f"{cut_nodes[b].target}: no tensor crosses this cut, so the stages after it do not "
                                "depend on the ones before; cut where an activation flows")
    return _Split(gm, order, stage_of, live, structure, result, inputs, cut_nodes, n_stages)


def _describe(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"module '{node.target}'"
    if node.op == "placeholder":
        return f"input '{node.target}'"
    return f"{getattr(node.target, '__name__', node.target)}()"

"""Stage modules: one ``fx.GraphModule`` per stage, holding the original module objects at their
original paths, with the code that sends and receives what crosses its cuts; ``split_model``."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn

from ...errors import PipelineError
from .partition import _Leaf, _Split, _context_parallel, _describe, _enclosing_paths, _leaves_of, _lookup, _partition
from .transport import (_anchor_output, _anchor_scalar, _make_list, _make_size, _make_tuple, _recv_number,
                        _recv_plain_value, _relay, _send_grad_value, _send_number, _send_plain_value)

logger = logging.getLogger("schedlang.distributed.pipeline")


def _stage_graph(split: _Split, s: int, device: torch.device) -> fx.Graph:
    g = fx.Graph()
    env: Dict[fx.Node, Any] = {}
    attrs: Dict[str, fx.Node] = {}
    last = s == split.n_stages - 1
    received: Dict[fx.Node, List[fx.Node]] = {}
    buffers: List[fx.Node] = []

    def arg(x: fx.Node):
        if x.op == "get_attr":
            if x.target not in attrs:
                attrs[x.target] = g.get_attr(x.target)
            return attrs[x.target]
        return env[x]

    if s == 0:
        for p in split.inputs:
            env[p] = g.node_copy(p, arg)
    else:
        for v in split.live[s - 1]:
            phs = [g.placeholder(f"{v.name}_{i}") for i in range(len(_leaves_of(split.structure[v])))]
            received[v] = phs
            buffers.extend(phs)
        if s > 1:
            buffers.append(g.placeholder("_pipeline_anchor"))
        for v, phs in received.items():
            if any(split.stage_of.get(u, split.n_stages - 1) == s for u in v.users):
                env[v] = _rebuild(g, split.structure[v], iter(phs))
    for n in split.order:
        if split.stage_of[n] == s and n.op != "placeholder":
            env[n] = g.node_copy(n, arg)
    if last:
        out = env[split.output]
        if buffers:
            out = g.call_function(_anchor_output, (out, *buffers))
        g.output(out)
        return g
    leaves: List[fx.Node] = []
    boundary = split.cut_nodes[s].target
    for v in split.live[s]:
        if v in received:
            leaves.extend(g.call_function(_relay, (ph,)) for ph in received[v])
            continue
        for node, _ in _emit(g, split.structure[v], env[v], device, v.name, f"(computed by {_describe(v)}), "
                             f"sent after '{boundary}',"):
            leaves.append(node)
    if buffers:
        leaves.append(g.call_function(_anchor_scalar, tuple(buffers)))
    g.output(tuple(leaves))
    return g


def _emit(g: fx.Graph, structure, value, device, label: str, context: str):
    """(node, leaf) for every tensor sent for ``value``."""
    if isinstance(structure, _Leaf):
        where = f"the value '{label}' {context}"
        if structure.kind == "grad":
            yield g.call_function(_send_grad_value, (value, where)), structure
        elif structure.kind == "plain":
            yield g.call_function(_send_plain_value, (value, device, where)), structure
        else:
            yield g.call_function(_send_number, (value, device, where)), structure
        return
    if structure[0] == "seq":
        for i, child in enumerate(structure[2]):
            item = g.call_function(_getitem, (value, i))
            yield from _emit(g, child, item, device, f"{label}[{i}]", context)


def _getitem(value, index):
    return value[index]


def _rebuild(g: fx.Graph, structure, phs):
    if isinstance(structure, _Leaf):
        ph = next(phs)
        if structure.kind == "grad":
            return ph
        if structure.kind == "plain":
            return g.call_function(_recv_plain_value, (ph, structure.info))
        return g.call_function(_recv_number, (ph, structure.info))
    if structure[0] == "seq":
        items = [_rebuild(g, child, phs) for child in structure[2]]
        make = {tuple: _make_tuple, list: _make_list, torch.Size: _make_size}[structure[1]]
        return g.call_function(make, tuple(items))
    return structure[1]


def _stage_module(split: _Split, model: nn.Module, s: int, device: torch.device) -> fx.GraphModule:
    graph = _stage_graph(split, s, device)
    root: Dict[str, Any] = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            root[node.target] = _resolve(split.gm, model, node.target)
    stage = fx.GraphModule(root, graph, class_name="StageModule")
    for node in graph.nodes:
        if node.op == "get_attr" and isinstance(root[node.target], torch.Tensor):
            owner_path, _, name = node.target.rpartition(".")
            owner = stage.get_submodule(owner_path)
            if name in owner._buffers and not _persistent(model, node.target):
                owner._non_persistent_buffers_set.add(name)
    _restore_containers(stage, model)
    stage._schedlang_stage_index = s
    cp_group = _context_parallel(model)
    if s == 0 and cp_group is not None:
        # the root's forward, whose pre-hook keeps this rank's tokens, never runs under a pipeline: the first
        # stage takes the full sequences in its place and keeps this rank's tokens with their global positions
        from ..context_parallel import SplitInputs

        names = [n.target for n in graph.nodes if n.op == "placeholder"]
        stage.register_forward_pre_hook(SplitInputs(names, cp_group, "pipeline stage 0"), with_kwargs=True)
        stage._schedlang_context_parallel = cp_group
    return stage


def _resolve(gm: fx.GraphModule, model: nn.Module, target: str) -> Any:
    try:
        return _lookup(model, target)
    except AttributeError:
        return _lookup(gm, target)  # a constant the tracer made (a config object, a literal tensor)


def _persistent(model: nn.Module, target: str) -> bool:
    owner_path, _, name = target.rpartition(".")
    try:
        owner = model.get_submodule(owner_path) if owner_path else model
    except AttributeError:
        return False
    if name in owner._parameters:
        return True
    return name in owner._buffers and name not in owner._non_persistent_buffers_set


def _restore_containers(stage: nn.Module, model: nn.Module) -> None:
    """Intermediate modules FX made plain get their container type back (``model.layers`` stays a
    ``ModuleList``, holding this stage's layers under their original indices)."""
    paths = sorted((p for p, _ in stage.named_modules() if p), key=lambda p: -p.count("."))
    for path in paths:
        new = stage.get_submodule(path)
        if type(new) is not nn.Module or new._parameters or new._buffers:
            continue
        try:
            orig = model.get_submodule(path)
        except AttributeError:
            continue
        for kind in (nn.ModuleList, nn.ModuleDict, nn.Sequential):
            if isinstance(orig, kind):
                container = kind()
                for key in orig._modules:
                    if key in new._modules:
                        container.add_module(key, new._modules[key])
                parent_path, _, name = path.rpartition(".")
                parent = stage.get_submodule(parent_path) if parent_path else stage
                parent._modules[name] = container
                break


def _attach_unused_state(stages: List[fx.GraphModule], model: nn.Module, enclosing: Sequence[str]) -> None:
    """Tensors no stage's code uses (a module the forward never calls) go to stage 0, so that the
    stages' state dicts together still hold every tensor of the model."""
    held = set()
    for stage in stages:
        held.update(id(t) for t in stage.parameters())
        held.update(id(t) for t in stage.buffers())
    inner = set(enclosing) | {""}
    first = stages[0]
    for owner_path, module in model.named_modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in store.items():
                if t is None or id(t) in held:
                    continue
                path = f"{owner_path}.{name}" if owner_path else name
                # the outermost module below the traced-through ones that owns it moves as a whole
                parts = owner_path.split(".") if owner_path else []
                for k in range(len(parts) + 1):
                    prefix = ".".join(parts[:k])
                    if prefix not in inner:
                        break
                else:
                    prefix = None
                if prefix is not None and prefix not in inner:
                    sub = model.get_submodule(prefix)
                    _place(first, prefix, sub)
                    held.update(id(x) for x in sub.parameters())
                    held.update(id(x) for x in sub.buffers())
                    logger.info("%s: not used by the forward; kept by pipeline stage 0", prefix)
                else:
                    owner = _ensure_path(first, owner_path)
                    if is_param:
                        owner.register_parameter(name, t)
                    else:
                        owner.register_buffer(name, t, persistent=name not in module._non_persistent_buffers_set)
                    held.add(id(t))
                    logger.info("%s: not used by the forward; kept by pipeline stage 0", path)


def _ensure_path(root: nn.Module, path: str) -> nn.Module:
    module = root
    for part in path.split(".") if path else ():
        if part not in module._modules:
            module.add_module(part, nn.Module())
        module = module._modules[part]
    return module


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    _ensure_path(root, parent_path)._modules[name] = module


def _check_cut_paths(model: nn.Module, cut_paths: Sequence[str]) -> List[str]:
    if isinstance(cut_paths, str) or not isinstance(cut_paths, (list, tuple)):
        raise PipelineError(f"pipeline: cut_paths must be a list of module paths, got {cut_paths!r}")
    if not cut_paths:
        raise PipelineError("pipeline: no pipeline stage is cut: mark boundaries with sch[path].cut_pipeline_stage()")
    seen = set()
    for path in cut_paths:
        if not isinstance(path, str) or not path:
            raise PipelineError(f"{path!r}: a cut must name a submodule (the root cannot end a stage)")
        if path in seen:
            raise PipelineError(f"{path}: cut twice; each module can end one pipeline stage")
        seen.add(path)
        try:
            model.get_submodule(path)
        except AttributeError:
            raise PipelineError(f"{path}: no such submodule in {type(model).__name__} to end a pipeline stage "
                                "after; cut_pipeline_stage() must be called on a submodule's path") from None
    return list(cut_paths)


def split_model(model: nn.Module, cut_paths: Sequence[str], device: Optional[torch.device] = None,
                example_inputs: Optional[Sequence[Any]] = None) -> List[fx.GraphModule]:
    """All stage modules of ``model`` cut after ``cut_paths`` (see the module docstring), in order.

    Stage 0 takes the model's inputs; stage ``k`` takes the tensors stage ``k - 1`` returns (a
    tuple); the last returns the output tensor. ``example_inputs`` (only their shapes and dtypes
    count) tell what crosses the cuts of a model that is not a transformers model; without them
    that is checked when the stages run. Running the stages in a chain computes the model::

        stages = split_model(model, ["model.layers.1"])
        logits = stages[1](*stages[0](input_ids))
    """
    cut_paths = _check_cut_paths(model, cut_paths)
    if device is None:
        device = next((t.device for t in model.parameters()), torch.device("cpu"))
    split = _partition(model, cut_paths, example_inputs)
    stages = [_stage_module(split, model, s, device) for s in range(split.n_stages)]
    _attach_unused_state(stages, model, _enclosing_paths(cut_paths))
    return stages

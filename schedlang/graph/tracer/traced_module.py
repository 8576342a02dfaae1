"""The traced module: ``TracedModule`` (deep copy and pickle keep what the graph does not hold),
``ModuleAttributes`` and rebuilding a module around a traced graph."""

from __future__ import annotations

import collections
import copy
import dataclasses
import types
from typing import Any, Dict, Optional

import torch
import torch.fx as fx
from torch import nn

from ...module_record import RECORD_ATTR, ModuleRecord
from .tracer_base import TracerBase


class ModuleAttributes:
    """Read-only snapshot of a module's plain attributes, passed to a leaf function in place
    of the module (a graph cannot refer to the module that runs it).

    Example: ``ModuleAttributes(attn).num_key_value_groups == attn.num_key_value_groups``.
    """

    def __init__(self, module: nn.Module):
        for key, value in vars(module).items():
            if not key.startswith("_") and not isinstance(value, (nn.Module, torch.Tensor)):
                self.__dict__[key] = value
        self.__dict__["training"] = module.training
        self.__dict__["module_type"] = type(module).__qualname__

    def __setattr__(self, key, value):
        raise AttributeError(f"ModuleAttributes of {self.module_type} is read-only")

    def __repr__(self) -> str:
        return f"ModuleAttributes({self.module_type})"


class TracedModule(fx.GraphModule):
    """The ``fx.GraphModule`` that ``trace`` produces.

    Unlike a plain ``GraphModule``, a deep copy or a pickle (``torch.save``) keeps
    everything that is not in the graph: forward hooks, sync-op children, unused
    parameters, shard records, container types; and unpickling does not trace again.
    """

    def __deepcopy__(self, memo):
        cls = type(self)
        res = cls.__new__(cls)
        memo[id(self)] = res
        state = copy.deepcopy(self.__dict__, memo)
        graph = state.pop("_graph")
        res.__dict__.update(state)
        res.__class__.__name__ = type(self).__name__
        res.graph = graph  # sets the owning module and regenerates the code
        return res

    def __reduce__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in ("_graph", "_code", "_lineno_map")}
        return (_rebuild_traced_module, (type(self).__name__, state, _graph_to_data(self.graph)))


class _NodeRef:
    """A reference to a node by name, in a pickled graph."""

    def __init__(self, name: str):
        self.name = name


def _graph_to_data(graph: fx.Graph) -> Dict[str, Any]:
    def ref(n):
        return _NodeRef(n.name)

    nodes = [(n.op, n.name, n.target, fx.node.map_arg(n.args, ref), fx.node.map_arg(n.kwargs, ref))
             for n in graph.nodes]
    return {"nodes": nodes, "codegen": graph._codegen}


def _graph_from_data(data: Dict[str, Any]) -> fx.Graph:
    graph = fx.Graph()
    graph._codegen = data["codegen"]
    by_name: Dict[str, fx.Node] = {}

    def resolve(value):
        if isinstance(value, _NodeRef):
            return by_name[value.name]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*[resolve(v) for v in value])
        if isinstance(value, (list, tuple)):
            return type(value)(resolve(v) for v in value)
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(resolve(value.start), resolve(value.stop), resolve(value.step))
        return value

    for op, name, target, args, kwargs in data["nodes"]:
        node = graph.create_node(op, target, resolve(args), resolve(kwargs), name=name)
        by_name[name] = node
    return graph


def _rebuild_traced_module(class_name: str, state: Dict[str, Any], graph_data: Dict[str, Any]) -> "TracedModule":
    res = TracedModule.__new__(TracedModule)
    res.__dict__.update(state)
    res.__class__.__name__ = class_name
    res.graph = _graph_from_data(graph_data)
    return res


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _lookup(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _submodule_or_none(root: nn.Module, path: str) -> Optional[nn.Module]:
    if not path:
        return root
    module = root
    for part in path.split("."):
        module = module._modules.get(part)
        if module is None:
            return None
    return module


def build_traced_module(original: nn.Module, graph: fx.Graph, tracer: TracerBase) -> TracedModule:
    """Turn a traced graph into a :class:`TracedModule` that stands in for ``original``."""
    root: Dict[str, Any] = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            target = node.target
            if target in tracer.constants:
                root[target] = tracer.constants[target]
            elif target in tracer.children:
                root[target] = tracer.children[target][0]
            else:
                root[target] = _lookup(original, target)
    gm = TracedModule(root, graph, class_name="GraphModule")
    gm.training = original.training
    # constants are not state: keep them out of state_dict
    for name in tracer.constants:
        if name in gm._buffers:
            gm._non_persistent_buffers_set.add(name)

    _restore_missing_state(original, gm)
    _restore_order(original, gm)
    _restore_containers(original, gm)
    _carry_attributes(original, gm)
    gm._schedlang_input_names = tuple(tracer._spec.input_names()) if tracer._spec else ()
    gm._schedlang_traced_from = f"{type(original).__module__}.{type(original).__qualname__}"
    gm.recompile()
    return gm


def _restore_missing_state(original: nn.Module, gm: nn.Module) -> None:
    """Every module, parameter and buffer of ``original`` keeps its qualified name in ``gm``."""
    for path, module in original.named_modules(remove_duplicate=False):
        if not path:
            continue
        parent_path, _, name = path.rpartition(".")
        parent = _submodule_or_none(gm, parent_path)
        if parent is None or name in parent._modules:
            continue
        if isinstance(module, fx.GraphModule) and not any(True for _ in module.parameters()) and \
                not any(True for _ in module.buffers()):
            continue  # traced code of a stateless child now inlined: nothing left to keep
        parent.add_module(name, module)  # not used by the graph, but still part of the model
    for path, module in original.named_modules(remove_duplicate=False):
        target = _submodule_or_none(gm, path)
        if target is None or target is module:
            continue
        for name, p in module._parameters.items():
            if name not in target._parameters and name not in target._buffers:
                target.register_parameter(name, p)
        for name, b in module._buffers.items():
            if name not in target._buffers and name not in target._parameters:
                target.register_buffer(name, b, persistent=name not in module._non_persistent_buffers_set)
            elif name in module._non_persistent_buffers_set:
                target._non_persistent_buffers_set.add(name)


def _restore_order(original: nn.Module, gm: nn.Module) -> None:
    """Children, parameters and buffers in the original order (``print`` and ``state_dict`` as before)."""
    for path, orig in original.named_modules():
        new = _submodule_or_none(gm, path)
        if new is None or new is orig:
            continue
        for attr in ("_modules", "_parameters", "_buffers"):
            mine, theirs = getattr(new, attr), getattr(orig, attr)
            order = [k for k in theirs if k in mine] + [k for k in mine if k not in theirs]
            if order != list(mine):
                items = [(k, mine[k]) for k in order]
                mine.clear()
                mine.update(items)


def _restore_containers(original: nn.Module, gm: nn.Module) -> None:
    """Intermediate modules that FX created as plain ``nn.Module`` get their container type back."""
    paths = sorted((p for p, _ in original.named_modules() if p), key=lambda p: -p.count("."))
    for path in paths:
        orig = _submodule_or_none(original, path)
        new = _submodule_or_none(gm, path)
        if new is None or type(new) is not nn.Module or not isinstance(orig, (nn.ModuleList, nn.ModuleDict,
                                                                             nn.Sequential)):
            continue
        if set(new._modules) != set(orig._modules) or new._parameters or new._buffers:
            continue
        children = collections.OrderedDict((k, new._modules[k]) for k in orig._modules)
        if type(orig) is nn.ModuleList:
            rebuilt = nn.ModuleList(list(children.values()))
        elif type(orig) is nn.ModuleDict:
            rebuilt = nn.ModuleDict(children)
        elif type(orig) is nn.Sequential:
            rebuilt = nn.Sequential(children)
        else:
            rebuilt = None
        if rebuilt is None:
            continue
        rebuilt.training = new.training
        parent_path, _, name = path.rpartition(".")
        setattr(_submodule_or_none(gm, parent_path), name, rebuilt)


def _carry_attributes(original: nn.Module, gm: nn.Module) -> None:
    """Hooks, schedlang records and plain attributes move to the module now at each path."""
    for path, module in original.named_modules(remove_duplicate=False):
        target = _submodule_or_none(gm, path)
        if target is None or target is module:
            continue
        for key, value in module.__dict__.items():
            if key.startswith("_schedlang_") and key not in target.__dict__:
                if key == RECORD_ATTR and isinstance(value, ModuleRecord):
                    # the record moves with the module; shards only of the tensors the new module owns
                    owned = set(target._parameters) | set(target._buffers)
                    value = dataclasses.replace(value, shards={k: v for k, v in value.shards.items() if k in owned})
                object.__setattr__(target, key, value)
        if path == "" or isinstance(target, fx.GraphModule):
            _move_hooks(module, target)
            _copy_plain_attributes(module, target)


def _move_hooks(src: nn.Module, dst: nn.Module) -> None:
    for name in _HOOK_DICTS:
        hooks = getattr(src, name, None)
        if hooks:
            getattr(dst, name).update(hooks)
    if getattr(src, "_is_full_backward_hook", None) is not None:
        dst._is_full_backward_hook = src._is_full_backward_hook
    fwd = src.__dict__.get("forward")
    if isinstance(fwd, types.MethodType) and fwd.__self__ is src:
        # an instance-level forward wrapper (checkpointing) keeps wrapping the traced forward
        dst.forward = types.MethodType(fwd.__func__, dst)


def _copy_plain_attributes(src: nn.Module, dst: nn.Module) -> None:
    for key, value in src.__dict__.items():
        if key.startswith("_") or key == "forward" or hasattr(dst, key):
            continue
        if isinstance(value, (nn.Module, torch.Tensor)):
            continue
        dst.__dict__[key] = value



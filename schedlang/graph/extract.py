"""Taking a subgraph out of a traced module as a standalone ``GraphModule``: what fusion lowers and what
checkpointing recomputes (:mod:`schedlang.graph.subgraph` puts the result back).

Inputs of a subgraph are the values it reads from outside, in order; outputs are its nodes used outside
it, in graph order. With ``functionalize``, modules holding parameters become functional calls whose
parameters are inputs, so the parameters keep their place, shard record and name.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Dict, List, Optional, Sequence

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..errors import ScheduleValueError
from ..module_record import module_record

__all__ = ["extract_subgraph", "inputs_of", "outputs_of", "has_hooks", "has_sync", "ParamInput"]


@dataclasses.dataclass(frozen=True)
class ParamInput:
    """A parameter a fused subgraph reads; becomes a ``get_attr`` node in the parent."""

    target: str


def inputs_of(nodes: Sequence[fx.Node]) -> List[fx.Node]:
    inside = set(nodes)
    inputs: List[fx.Node] = []
    for n in nodes:
        def visit(arg):
            if arg not in inside and arg not in inputs:
                inputs.append(arg)
            return arg

        fx.node.map_arg((n.args, n.kwargs), visit)
    return inputs


def outputs_of(nodes: Sequence[fx.Node]) -> List[fx.Node]:
    inside = set(nodes)
    return [n for n in nodes if any(u not in inside for u in n.users)]


def has_hooks(module: nn.Module) -> bool:
    return any(bool(getattr(module, name, None)) for name in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")) or has_sync(module)


def has_sync(module: nn.Module) -> bool:
    return bool(module_record(module).syncs)


def _functional_call(module: nn.Module, target: str):
    """``(function, argument builder)`` for a module whose parameters can be passed in, or None."""
    def p(name):
        return ParamInput(f"{target}.{name}") if getattr(module, name, None) is not None else None

    if type(module) in (nn.Linear,) or type(module).__name__ == "LinearWithSeparateBias":
        if type(module).__name__ == "LinearWithSeparateBias" and has_sync(module):
            return None
        if type(module).__name__ == "LinearWithSeparateBias":
            return lambda x: [(F.linear, (x, p("weight")), {}), (operator.add, ("$0", p("bias")), {})] \
                if module.bias is not None else [(F.linear, (x, p("weight")), {})]
        return lambda x: [(F.linear, (x, p("weight"), p("bias")), {})]
    if type(module) is nn.LayerNorm:
        return lambda x: [(F.layer_norm, (x, tuple(module.normalized_shape), p("weight"), p("bias"), module.eps), {})]
    if hasattr(nn, "RMSNorm") and type(module) is nn.RMSNorm:
        return lambda x: [(F.rms_norm, (x, tuple(module.normalized_shape), p("weight"), module.eps), {})]
    convolutions = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
    if type(module) in convolutions and module.padding_mode == "zeros":
        fn = convolutions[type(module)]
        return lambda x: [(fn, (x, p("weight"), p("bias"), module.stride, module.padding, module.dilation,
                                module.groups), {})]
    if type(module) is nn.Embedding:
        return lambda x: [(F.embedding, (x, p("weight"), module.padding_idx, module.max_norm, module.norm_type,
                                         module.scale_grad_by_freq, module.sparse), {})]
    return None


def _is_stateless(module: nn.Module) -> bool:
    return not any(True for _ in module.parameters()) and not any(True for _ in module.buffers())


def extract_subgraph(gm: fx.GraphModule, nodes: Sequence[fx.Node], *, functionalize: bool = False,
                     where: str = "<root>", primitive: str = "fuse"):
    """The subgraph ``nodes`` of ``gm`` as a standalone GraphModule.

    Returns ``(module, inputs, outputs)``: placeholders stand for ``inputs`` (nodes of
    ``gm``, or parameters to read with ``get_attr`` when ``functionalize``), the output is
    one value or a tuple for ``outputs`` (nodes of ``gm`` in graph order). With
    ``functionalize``, modules holding parameters (``nn.Linear``, ``nn.LayerNorm``,
    ``nn.RMSNorm``, ``nn.Embedding``, zero-padded ``nn.Conv1d/2d/3d``) become functional calls whose parameters are inputs,
    so they stay where they are; other parameter-free modules move into the subgraph.
    """
    body = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    inputs: List[Any] = []
    used_names = set()

    def placeholder_for(value, hint: str) -> fx.Node:
        name = hint.replace(".", "_")
        base, k = name, 1
        while name in used_names:
            name, k = f"{base}_{k}", k + 1
        used_names.add(name)
        inputs.append(value)
        return body.placeholder(name)

    for value in inputs_of(nodes):
        env[value] = placeholder_for(value, value.name)
    param_nodes: Dict[str, fx.Node] = {}
    root: Dict[str, Any] = {}

    def param(ref: Optional[ParamInput]) -> Any:
        if ref is None:
            return None
        if ref.target not in param_nodes:
            param_nodes[ref.target] = placeholder_for(ref, ref.target)
        return param_nodes[ref.target]

    for node in nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if functionalize and isinstance(module, fx.GraphModule) and _is_stateless(module) \
                    and not has_hooks(module):
                # a traced parameter-free child (an activation wrapper): its ops join the subgraph
                env[node] = _inline(body, module, node, env, root, node.target)
                continue
            if functionalize and has_hooks(module):
                raise ScheduleValueError(
                    f"{where}: cannot {primitive} '{node.name}': module '{node.target}' ({type(module).__name__}) has "
                    "hooks or sync points, which the new module would drop; leave it out of the subgraph, or remove "
                    "its hooks first")
            calls = _functional_call(module, node.target) if functionalize else None
            if calls is not None and len(node.args) == 1 and not node.kwargs:
                value = env[node.args[0]] if isinstance(node.args[0], fx.Node) else node.args[0]
                for fn, args, kwargs in calls(value):
                    args = tuple(value if a == "$0" else param(a) if isinstance(a, ParamInput) else a for a in args)
                    value = body.call_function(fn, args, kwargs)
                env[node] = value
                continue
            if functionalize and not _is_stateless(module):
                raise ScheduleValueError(
                    f"{where}: cannot {primitive} '{node.name}': module '{node.target}' "
                    f"({type(module).__name__}) holds parameters that cannot be passed in as inputs; trace with "
                    "flatten=True so its operations are in the graph, or leave it out of the subgraph")
            root[node.target] = module
        env[node] = body.node_copy(node, lambda a: env[a])
    outputs = outputs_of(nodes)
    body.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    module = fx.GraphModule(root, body, class_name="Subgraph")
    return module, inputs, outputs


def _inline(body: fx.Graph, module: fx.GraphModule, call: fx.Node, env: Dict[fx.Node, Any], root: Dict[str, Any],
            prefix: str) -> Any:
    """Copy the ops of ``module`` (called by ``call``) into ``body``; returns its output value."""
    from .tracer import check_specialized_arguments

    def outer(v):
        return env[v] if isinstance(v, fx.Node) else v

    values: Dict[fx.Node, Any] = {}
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    for i, ph in enumerate(placeholders):
        if i < len(call.args):
            values[ph] = fx.node.map_arg(call.args[i], outer)
        elif ph.target in call.kwargs:
            values[ph] = fx.node.map_arg(call.kwargs[ph.target], outer)
        else:
            values[ph] = ph.args[0] if ph.args else None
    for n in module.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            return fx.node.map_arg(n.args[0], lambda a: values[a])
        if n.op == "call_function" and n.target is check_specialized_arguments:
            continue  # the call site passes the traced values
        target = f"{prefix}.{n.target}" if n.op in ("get_attr", "call_module") else n.target
        if n.op == "get_attr":
            root[target] = _attr(module, n.target)
            values[n] = body.get_attr(target)
        elif n.op == "call_module":
            inner = module.get_submodule(n.target)
            if isinstance(inner, fx.GraphModule) and _is_stateless(inner) and not has_hooks(inner):
                values[n] = _inline(body, inner, n, values, root, target)
                continue
            root[target] = inner
            values[n] = body.create_node("call_module", target, fx.node.map_arg(n.args, lambda a: values[a]),
                                         fx.node.map_arg(n.kwargs, lambda a: values[a]))
        else:
            values[n] = body.node_copy(n, lambda a: values[a])
    raise ScheduleValueError(f"{prefix}: traced module has no output")  # pragma: no cover


def _attr(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj

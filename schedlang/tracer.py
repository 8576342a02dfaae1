"""Slapo's tracing entry points, on schedlang's hierarchy-keeping tracer (:mod:`schedlang.graph.tracer`).

One tracer handles plain PyTorch modules and transformers 5.x models alike (Slapo's
``tracer="pytorch"`` / ``"huggingface"`` choice is accepted and ignored). Failures raise
:class:`schedlang.TraceError` instead of returning the module untraced.

Example::

    gm = trace(model, flatten=True)
    gm = trace(model, leaf_modules=["GPT2Attention"])   # class names or paths stay calls
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import fx, nn

from .errors import ScheduleTypeError

__all__ = ["trace", "trace_submodule", "is_fx_tracable", "fix_hf_module", "generate_hf_tracer_inputs"]

_TRACER_NAMES = ("pytorch", "huggingface", "fx", None)


def is_fx_tracable(mod: nn.Module) -> bool:
    """False for modules that ask to stay whole (``traceable = False``, or a forward set on the instance)."""
    return getattr(mod, "traceable", True) is not False and "forward" not in mod.__dict__


def _leaf_specs(model: nn.Module, leaf_modules: Optional[Iterable[Any]]) -> List[Any]:
    """Slapo names leaves by class name; schedlang by type or path: turn class names into types."""
    if not leaf_modules:
        return []
    paths = {name for name, _ in model.named_modules()}
    types = {}
    for _, m in model.named_modules():
        types.setdefault(type(m).__name__, type(m))
    specs: List[Any] = []
    for item in leaf_modules:
        if isinstance(item, type) or item in paths:
            specs.append(item)
        elif isinstance(item, str) and item in types:
            specs.append(types[item])
        elif isinstance(item, str):
            specs.append(item)  # a path the tracer will report if it does not exist
        else:
            raise ScheduleTypeError(f"trace: leaf_modules holds {item!r}; give module classes, class names or "
                                    "submodule paths")
    for _, m in model.named_modules():  # modules that ask to stay whole
        if m is not model and not is_fx_tracable(m) and "forward" not in m.__dict__ and type(m) not in specs:
            specs.append(type(m))
    return specs


def trace(model: nn.Module, **kwargs: Any) -> fx.GraphModule:
    """Trace ``model`` into a ``GraphModule`` (keys: ``recursive``, ``flatten``, ``leaf_modules``,
    ``concrete_args``; ``tracer`` is accepted for compatibility). The model is not changed."""
    from .graph.tracer import trace_module

    tracer = kwargs.pop("tracer", None)
    if tracer not in _TRACER_NAMES:
        raise ScheduleTypeError(f"trace: unknown tracer {tracer!r}: valid are 'pytorch', 'huggingface'")
    kwargs.pop("config", None)  # Slapo's HF tracer wanted the config; ours reads it from the model
    unknown = set(kwargs) - {"recursive", "flatten", "leaf_modules", "concrete_args"}
    if unknown:
        raise ScheduleTypeError(f"trace: unknown options {sorted(unknown)}: valid are recursive, flatten, "
                                "leaf_modules, concrete_args, tracer")
    return trace_module(model, recursive=kwargs.get("recursive", True), flatten=kwargs.get("flatten", False),
                        leaf_modules=_leaf_specs(model, kwargs.get("leaf_modules")),
                        concrete_args=kwargs.get("concrete_args") or None)


def trace_submodule(root: nn.Module, tracer_class=None, is_top: bool = False, call_node: Optional[fx.Node] = None,
                    **kwargs: Any) -> fx.GraphModule:
    """Trace one submodule (Slapo's per-module step). schedlang's tracer already records each
    child's real call while tracing its parent, so ``tracer_class``, ``is_top`` and ``call_node``
    are not needed and are ignored."""
    return trace(root, **kwargs)


def fix_hf_module(root: nn.Module, root_graph: fx.Graph, submods: Dict[str, Any]) -> fx.Graph:
    """Put every module and attribute ``root_graph`` refers to into ``submods`` (taken from ``root``),
    so that ``fx.GraphModule(submods, root_graph)`` can be built; returns the graph."""
    for node in root_graph.nodes:
        if node.op in ("call_module", "get_attr") and node.target not in submods:
            value: Any = root
            for atom in node.target.split("."):
                value = getattr(value, atom)
            submods[node.target] = value
    return root_graph


def generate_hf_tracer_inputs(root: nn.Module, tracer=None, is_top: bool = True, call_node: Optional[fx.Node] = None,
                              kwargs: Optional[Dict[str, Any]] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Example inputs for tracing ``root``: ``(concrete_args, dummy_inputs)``.

    At the top (``is_top``), every ``forward`` parameter not in ``kwargs["concrete_args"]`` (by
    default: the main input and the parameters without defaults) gets a
    ``(2, 8)`` example: token ids (``*_ids``, below the config's vocabulary size), ones for masks,
    zeros otherwise. Below the top, the tensor arguments of ``call_node`` get float examples and
    the other parameters are fixed at their defaults.
    """
    from .graph.tracer.hf_bridge import EXAMPLE_BATCH, EXAMPLE_SEQUENCE

    kwargs = kwargs if kwargs is not None else {}
    shape = (EXAMPLE_BATCH, EXAMPLE_SEQUENCE)
    params = inspect.signature(root.forward).parameters
    device = next((p.device for p in root.parameters()), torch.device("cpu"))
    if is_top:
        if "concrete_args" in kwargs:
            concrete_args = dict(kwargs["concrete_args"])
        else:  # the model's main input and the parameters without defaults; the rest keep their defaults
            main = getattr(root, "main_input_name", "input_ids")
            concrete_args = {n: p.default for n, p in params.items()
                             if n != main and p.default is not inspect.Parameter.empty}
        config = getattr(root, "config", kwargs.get("config"))
        vocab = getattr(config, "vocab_size", 2) or 2
        dummy: Dict[str, Any] = {}
        for name in params:
            if name in concrete_args or params[name].kind in (inspect.Parameter.VAR_POSITIONAL,
                                                              inspect.Parameter.VAR_KEYWORD):
                continue
            if name.endswith("_ids") or name == "labels":
                dummy[name] = torch.randint(0, vocab, shape, device=device)
            elif "mask" in name:
                dummy[name] = torch.ones(shape, dtype=torch.long, device=device)
            else:
                dummy[name] = torch.zeros(shape, device=device)
        return concrete_args, dummy
    if call_node is None:
        raise ScheduleTypeError("generate_hf_tracer_inputs: a submodule (is_top=False) needs the call_node that "
                                "calls it in its parent's graph")
    names = list(params)
    dummy = {}
    for i, arg in enumerate(call_node.args):
        if isinstance(arg, fx.Node) and i < len(names):
            dummy[names[i]] = torch.zeros(shape, device=device)
    for key, arg in call_node.kwargs.items():
        if isinstance(arg, fx.Node):
            dummy[key] = torch.zeros(shape, device=device)
    concrete_args = {p.name: p.default for p in params.values() if p.name not in dummy
                     and p.default is not inspect.Parameter.empty}
    return concrete_args, dummy

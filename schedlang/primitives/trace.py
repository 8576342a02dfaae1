"""``trace(recursive=True, flatten=False, leaf_modules=None, tracer="fx", concrete_args=None)``.

Turns the module at this path into an FX graph (a ``TracedModule``), so that ``find``,
``fuse``, ``replace``/``checkpoint`` on subgraphs and ``horizontal_fuse`` can work on it.
Only this submodule is traced ("trace by need"); the rest of the model is untouched.

* ``recursive``: trace children too (each into its own graph unless ``flatten``); with
  ``False`` every child stays a ``call_module`` leaf.
* ``flatten``: one graph for the whole submodule, children inlined (needed to match or
  fuse across a module boundary, e.g. a decomposed linear's bias add with the next GELU).
* ``leaf_modules``: module types, or names relative to this path, to keep as calls.
* ``tracer``: ``"fx"`` (symbolic tracing guided by fake-tensor examples, see
  :mod:`schedlang.graph.tracer`).
* ``concrete_args``: values to specialize ``forward``'s arguments on; a tensor is an
  *example input* (the argument stays an input, its shape guides Python control flow);
  ``schedlang.graph.PH`` makes an argument an input without an example.

Without ``concrete_args``, a submodule of a transformers model is traced with the
arguments it really receives: the enclosing model runs once on fake tensors and the call
is recorded. The graph has no KV cache, so the enclosing model's ``config.use_cache`` is
then set to False. Shard records, sync points, hooks and checkpointed modules survive
tracing.

Example::

    sch["model.layers.0.mlp"].trace(flatten=True)
    print(sch["model.layers.0.mlp"].mod.code)
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any, Dict

import torch
from torch import nn

from ..errors import ScheduleKeyError, ScheduleTypeError, ScheduleValueError
from .base import Primitive, encode_value, register_primitive

__all__ = ["Trace", "TRACERS"]

logger = logging.getLogger("schedlang.primitives.trace")

#: the tracers ``trace`` accepts
TRACERS = ("fx",)


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _import_type(name: str) -> type:
    module_name, _, qualname = name.rpartition(".")
    while module_name:
        try:
            obj = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            return obj
        except (ImportError, AttributeError):
            module_name, _, head = module_name.rpartition(".")
            qualname = f"{head}.{qualname}"
    raise ScheduleValueError(f"cannot import module type {name!r} named in the plan")


@register_primitive
class Trace(Primitive):
    name = "trace"

    @classmethod
    def validate(cls, sch, recursive=True, flatten=False, leaf_modules=None, tracer="fx", concrete_args=None):
        from ..graph.tracer import forward_parameters

        where = sch.path or "<root>"
        for arg, value in (("recursive", recursive), ("flatten", flatten)):
            if not isinstance(value, bool):
                raise ScheduleTypeError(f"{where}: trace {arg} must be True or False, got {value!r}")
        if tracer not in TRACERS:
            raise ScheduleValueError(f"{where}: unknown tracer {tracer!r}: valid tracers are "
                                     f"{', '.join(repr(t) for t in TRACERS)}")
        leaves = []
        if leaf_modules is not None:
            if isinstance(leaf_modules, (str, type)) or not isinstance(leaf_modules, (list, tuple, set)):
                leaf_modules = [leaf_modules]
            for item in leaf_modules:
                if isinstance(item, type) and issubclass(item, nn.Module):
                    leaves.append(item)
                elif isinstance(item, str):
                    try:
                        sch.mod.get_submodule(item)
                    except AttributeError:
                        raise ScheduleKeyError(f"{where}: leaf_modules names '{item}', which is not a submodule here "
                                               "(names are relative to this schedule's path)") from None
                    leaves.append(item)
                else:
                    raise ScheduleTypeError(f"{where}: leaf_modules entries must be nn.Module subclasses or submodule "
                                            f"names, got {item!r}")
        if concrete_args is not None:
            if not isinstance(concrete_args, dict) or not all(isinstance(k, str) for k in concrete_args):
                raise ScheduleTypeError(f"{where}: concrete_args must be a dict from argument names to values, got "
                                        f"{concrete_args!r}")
            params = forward_parameters(sch.mod)
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
                names = [p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL]
                unknown = [k for k in concrete_args if k not in names]
                if unknown:
                    raise ScheduleValueError(
                        f"{where}: concrete_args names {', '.join(repr(u) for u in unknown)}, which "
                        f"{'is' if len(unknown) == 1 else 'are'} not an argument of "
                        f"{type(sch.mod).__name__}.forward; valid arguments are {', '.join(names) or 'none'}")
            concrete_args = dict(concrete_args)
        return {"recursive": recursive, "flatten": flatten, "leaf_modules": leaves or None, "tracer": tracer,
                "concrete_args": concrete_args}

    @classmethod
    def apply(cls, sch, recursive=True, flatten=False, leaf_modules=None, tracer="fx", concrete_args=None):
        from ..graph import tracer as T

        module = sch.mod
        fake_mode = T._new_fake_mode()
        ancestor = _hf_ancestor(sch, module)
        call = None
        if concrete_args is None and ancestor is not None:
            try:
                call = T.capture_call(ancestor[1], module, fake_mode)
            except Exception as e:  # fall back to the signature; tracing says what is missing
                logger.debug("%s: could not record the call inside %s: %s", sch.path, ancestor[0] or "<root>", e)
        gm = T.trace_module(module, path=sch.path, recursive=recursive, flatten=flatten, leaf_modules=leaf_modules,
                            concrete_args=concrete_args, call=call, fake_mode=fake_mode)
        sch._set_module(gm)
        _keep_graphs_as_traced(sch, gm)
        config = getattr(ancestor[1], "config", None) if ancestor is not None else None
        if getattr(config, "use_cache", None):
            # the traced graph has no KV cache: make the enclosing model stop passing one
            config.use_cache = False
            logger.info("%s: traced without a KV cache; set config.use_cache = False on %s", sch.path,
                        ancestor[0] or "<root>")
        return None

    @classmethod
    def encode_args(cls, args: Dict[str, Any], step_index: int, path: str) -> Dict[str, Any]:
        from ..graph.tracer import PH

        where = f"step {step_index} (trace at '{path or '<root>'}')"
        out = dict(args)
        if args.get("leaf_modules"):
            out["leaf_modules"] = [{"module_type": _type_name(t)} if isinstance(t, type) else t
                                   for t in args["leaf_modules"]]
        if args.get("concrete_args") is not None:
            encoded = {}
            for k, v in args["concrete_args"].items():
                if v is PH:
                    encoded[k] = {"placeholder": True}
                elif isinstance(v, torch.Tensor):
                    encoded[k] = {"tensor_example": {"shape": list(v.shape), "dtype": str(v.dtype).split(".")[-1]}}
                else:
                    encoded[k] = {"value": encode_value(v, f"{where}, concrete_args['{k}']")}
            out["concrete_args"] = encoded
        return super().encode_args(out, step_index, path)

    @classmethod
    def decode_args(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        from ..graph.tracer import PH

        out = dict(data)
        if data.get("leaf_modules"):
            out["leaf_modules"] = [_import_type(t["module_type"]) if isinstance(t, dict) else t
                                   for t in data["leaf_modules"]]
        if data.get("concrete_args") is not None:
            decoded = {}
            for k, v in data["concrete_args"].items():
                if v.get("placeholder"):
                    decoded[k] = PH
                elif "tensor_example" in v:
                    ex = v["tensor_example"]
                    decoded[k] = torch.empty(ex["shape"], dtype=getattr(torch, ex["dtype"]), device="meta")
                else:
                    decoded[k] = v["value"]
            out["concrete_args"] = decoded
        return out


def _hf_ancestor(sch, module: nn.Module):
    """``(path, module)`` of the nearest transformers model strictly enclosing ``module``, or None."""
    from ..graph import tracer as T

    if T.is_hf_model(module) or not sch.path:
        return None
    root = sch.root.mod
    parts = sch.path.split(".")
    for k in range(len(parts) - 1, -1, -1):
        ancestor_path = ".".join(parts[:k])
        ancestor = root.get_submodule(ancestor_path) if ancestor_path else root
        if T.is_hf_model(ancestor):
            return ancestor_path, ancestor
    return None


def _keep_graphs_as_traced(sch, gm) -> None:
    """Record each traced graph as first traced, in the schedule's metadata, so that a report can
    draw it beside what later steps (fuse, horizontal_fuse, replace) make of it."""
    import torch.fx as fx

    from ..report.graph_svg import describe_graph

    for relative, module in gm.named_modules():
        if isinstance(module, fx.GraphModule):
            path = ".".join(p for p in (sch.path, relative) if p)
            sch.root[path].metadata["graph_at_trace"] = describe_graph(module.graph, owner=module)

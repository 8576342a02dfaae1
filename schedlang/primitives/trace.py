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
  :mod:`schedlang.graph.tracer`). Slapo's ``"pytorch"`` and ``"huggingface"`` are the same
  tracer with torch.fx's input rule: when ``concrete_args`` is given, every ``forward``
  parameter it does not name is a graph input, in the signature's order (with ``"fx"`` such
  a parameter keeps its default). ``config`` (Slapo's HF tracer option) is the model config
  the examples of such inputs are shaped from when no enclosing model records the call.
  Slapo's ``"dynamo"`` is refused: its graphs of ATen-level or renamed modules are not the
  module hierarchy a schedule works on.
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

import inspect
import logging
from typing import Any, Dict, Optional, Sequence, Type, Union

import torch
from torch import nn

from ..errors import ScheduleKeyError, ScheduleTypeError, ScheduleValueError
from .base import Param, Primitive, register_primitive
from .params import Codec, DecodeContext, encode_value

__all__ = ["Trace", "TRACERS"]

logger = logging.getLogger("schedlang.primitives.trace")

#: the tracers ``trace`` accepts: schedlang's, and Slapo's names of torch.fx-style tracing (see the module docstring)
TRACERS = ("fx", "pytorch", "huggingface")
#: tracers following torch.fx's rule that every argument not in ``concrete_args`` is an input
FX_INPUT_RULE = ("pytorch", "huggingface")


class _ConfigCodec(Codec):
    """A transformers config as its class and its values (``to_dict``), rebuilt with ``from_dict``."""

    def encode(self, value, where):
        cls = type(value)
        return {"config_class": f"{cls.__module__}.{cls.__qualname__}", "values": value.to_dict()}

    def decode(self, data, ctx: DecodeContext):
        if not (isinstance(data, dict) and set(data) == {"config_class", "values"} and isinstance(data["values"], dict)):
            raise ctx.error(f"expected {{\"config_class\": \"package.module.Class\", \"values\": {{...}}}}, got {data!r}")
        cls = ctx.resolve_dotted(data["config_class"], base=object)
        return cls.from_dict(data["values"])


class _LeafModulesCodec(Codec):
    """Module types as ``{"module_type": "package.module.Class"}``, submodule names as they are."""

    def encode(self, value, where):
        return [{"module_type": f"{t.__module__}.{t.__qualname__}"} if isinstance(t, type) else t for t in value]

    def decode(self, data, ctx: DecodeContext):
        if not isinstance(data, list):
            raise ctx.error(f"expected a list of submodule names and {{\"module_type\": ...}} objects, got {data!r}")
        out = []
        for item in data:
            if isinstance(item, dict) and set(item) == {"module_type"}:
                out.append(ctx.resolve_dotted(item["module_type"]))
            elif isinstance(item, str):
                out.append(item)
            else:
                raise ctx.error(f"expected a submodule name or {{\"module_type\": \"package.module.Class\"}}, "
                                f"got {item!r}")
        return out


class _ConcreteArgsCodec(Codec):
    """Example tensors as their shape and dtype, ``PH`` as a placeholder flag, other values as they are."""

    def encode(self, value, where):
        from ..graph.tracer import PH

        encoded = {}
        for k, v in value.items():
            if v is PH:
                encoded[k] = {"placeholder": True}
            elif isinstance(v, torch.Tensor):
                encoded[k] = {"tensor_example": {"shape": list(v.shape), "dtype": str(v.dtype).split(".")[-1]}}
            else:
                encoded[k] = {"value": encode_value(v, f"{where}, concrete_args['{k}']")}
        return encoded

    def decode(self, data, ctx: DecodeContext):
        from ..graph.tracer import PH

        if not isinstance(data, dict):
            raise ctx.error(f"expected an object of argument names to values, got {data!r}")
        decoded = {}
        for k, v in data.items():
            if v == {"placeholder": True}:
                decoded[k] = PH
            elif isinstance(v, dict) and set(v) == {"tensor_example"}:
                decoded[k] = _example_tensor(v["tensor_example"], ctx, k)
            elif isinstance(v, dict) and set(v) == {"value"}:
                decoded[k] = v["value"]
            else:
                raise ctx.error(f"concrete_args['{k}'] must be {{\"placeholder\": true}}, {{\"tensor_example\": "
                                f"...}} or {{\"value\": ...}}, got {v!r}")
        return decoded


def _example_tensor(spec, ctx: DecodeContext, key: str) -> torch.Tensor:
    dtype = getattr(torch, spec.get("dtype", ""), None) if isinstance(spec, dict) and isinstance(
        spec.get("dtype"), str) else None
    shape = spec.get("shape") if isinstance(spec, dict) else None
    if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or not all(
            type(d) is int and d >= 0 for d in shape):
        raise ctx.error(f"concrete_args['{key}'] tensor_example must be {{\"shape\": [ints >= 0], \"dtype\": "
                        f"\"float32\" (a torch dtype)}}, got {spec!r}")
    return torch.empty(shape, dtype=dtype, device="meta")


@register_primitive
class Trace(Primitive):
    """Trace this submodule into an FX graph (hierarchy kept unless ``flatten``).

    ``leaf_modules`` lists module types or qualified names to keep as calls. A tensor in
    ``concrete_args`` is an example input (its shape guides Python control flow); any other
    value is fixed in the graph; ``schedlang.graph.PH`` keeps an argument an input.
    Failures raise :class:`schedlang.TraceError` naming the submodule and the cause.

    Example::

        sch["mlp"].trace(flatten=True)
    """

    name = "trace"
    params = (
        Param("recursive", bool, True, "trace children too (False: every child stays a call)"),
        Param("flatten", bool, False, "one graph for the whole submodule, children inlined"),
        Param("leaf_modules", Optional[Union[str, Type[nn.Module], Sequence[Any]]], None,
              "module types, or submodule names relative to this path, kept as calls", codec=_LeafModulesCodec(),
              expects="None, a submodule name, an nn.Module subclass or a list of them"),
        Param("tracer", str, "fx", "the tracer: 'fx', or Slapo's 'pytorch' / 'huggingface' (torch.fx's input rule)"),
        Param("concrete_args", Optional[Dict[str, Any]], None,
              "forward arguments to specialize on: example tensors, fixed values or schedlang.graph.PH",
              codec=_ConcreteArgsCodec(),
              type_error="{where}: concrete_args must be a dict from argument names to values, got {value}"),
        Param("config", Any, None, "Slapo's HF tracer option: the model config that shapes example inputs",
              codec=_ConfigCodec(), option=True),
    )

    @classmethod
    def validate(cls, sch, recursive=True, flatten=False, leaf_modules=None, tracer="fx", concrete_args=None,
                 config=None):
        from ..graph.tracer import forward_parameters

        where = sch.path or "<root>"
        if tracer == "dynamo":
            raise ScheduleValueError(f"{where}: tracer 'dynamo' is not supported: its graph (ATen operators, modules "
                                     "renamed) is not the module hierarchy a schedule works on; use tracer='fx' "
                                     "(Slapo's 'pytorch' and 'huggingface' mean the same tracer here)")
        if tracer not in TRACERS:
            raise ScheduleValueError(f"{where}: unknown tracer {tracer!r}: valid tracers are "
                                     f"{', '.join(repr(t) for t in TRACERS)}")
        if config is not None and not (hasattr(config, "to_dict") and hasattr(type(config), "from_dict")):
            raise ScheduleTypeError(f"{where}: trace config must be a transformers PretrainedConfig (Slapo's HF tracer "
                                    f"option), got {type(config).__name__}")
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
                        # Slapo names leaf classes by their class name
                        by_class = {type(m) for m in sch.mod.modules() if type(m).__name__ == item}
                        if len(by_class) != 1:
                            raise ScheduleKeyError(
                                f"{where}: leaf_modules names '{item}', which is neither a submodule here (names are "
                                "relative to this schedule's path) nor the class name of exactly one module type "
                                "under it") from None
                        leaves.append(by_class.pop())
                        continue
                    leaves.append(item)
                else:
                    raise ScheduleTypeError(f"{where}: leaf_modules entries must be nn.Module subclasses or submodule "
                                            f"names, got {item!r}")
        if concrete_args is not None:
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
        args = {"recursive": recursive, "flatten": flatten, "leaf_modules": leaves or None, "tracer": tracer,
                "concrete_args": concrete_args}
        if config is not None:
            args["config"] = config
        return args

    @classmethod
    def apply(cls, sch, recursive=True, flatten=False, leaf_modules=None, tracer="fx", concrete_args=None,
              config=None):
        from ..graph import tracer as T

        module = sch.mod
        fake_mode = T._new_fake_mode()
        ancestor = _hf_ancestor(sch, module)
        fx_rule = tracer in FX_INPUT_RULE and concrete_args is not None
        call = None
        if (concrete_args is None or fx_rule) and ancestor is not None:
            try:
                call = T.capture_call(ancestor[1], module, fake_mode)
            except Exception as e:  # fall back to the signature; tracing says what is missing
                logger.debug("%s: could not record the call inside %s: %s", sch.path, ancestor[0] or "<root>", e)
        with T.example_config(config):
            gm = T.trace_module(module, path=sch.path, recursive=recursive, flatten=flatten,
                                leaf_modules=leaf_modules, concrete_args=concrete_args, call=call,
                                fake_mode=fake_mode, unlisted_are_inputs=fx_rule)
        sch._set_module(gm)
        _keep_graphs_as_traced(sch, gm)
        config = getattr(ancestor[1], "config", None) if ancestor is not None else None
        if getattr(config, "use_cache", None):
            # the traced graph has no KV cache: make the enclosing model stop passing one
            config.use_cache = False
            logger.info("%s: traced without a KV cache; set config.use_cache = False on %s", sch.path,
                        ancestor[0] or "<root>")
        return None


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

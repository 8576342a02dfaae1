"""``SchedlangTracer``: hierarchy-keeping FX tracing, one graph per traced child module."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx
from torch import nn

from ...errors import SchedlangError, TraceError
from ...module_record import module_record
from .call_spec import CallSpec
from .common import (
    _P,
    UNKNOWN,
    _describe,
    _describe_node,
    _eliminate_dead_queries,
    _expression,
    _guard_value,
    _holds_tensor,
    _literal_default,
    _reserve_name,
)
from .examples import ExampleValues, _plain_modules
from .foreign_modules import GraphMark, OpaqueModuleCall, node_codes, owns_state
from .hf_bridge import _keep_mask_flags
from .leaf_policy import _hf_leaf_types, _sync_op_class
from .patches import _ACTIVE
from .specialization import check_specialized_arguments, check_traced_condition, check_traced_length
from .traced_module import ModuleAttributes, TracedModule, build_traced_module
from .tracer_base import TracerBase
from .training_mode import ModeDependentCall, _flipped_mode

logger = logging.getLogger("schedlang.graph.tracer")

@dataclasses.dataclass
class _Options:
    recursive: bool
    flatten: bool
    leaf_types: Tuple[type, ...]
    leaf_names: Set[str]
    fake_mode: Any


class SchedlangTracer(ExampleValues, TracerBase):
    """``fx.Tracer`` with example values, leaf functions and nested per-module tracing.

    Use :func:`trace_module`; this class is public for subclassing (e.g. more leaves).
    """

    def __init__(self, options: _Options, path: str = ""):
        super().__init__()
        self.proxy_buffer_attributes = True  # buffers are graph values too (BERT slices position_ids)
        self.options = options
        self.path = path
        self.metas: Dict[fx.Node, Any] = {}
        self.constants: Dict[str, Any] = {}
        self._constant_ids: Dict[int, str] = {}
        self.children: Dict[str, Tuple["TracedModule", Any]] = {}
        self.specializations: List[str] = []
        self._spec: Optional[CallSpec] = None
        self._param_names: Dict[int, str] = {}
        self._buffer_names: Dict[int, str] = {}
        self._module_names: Dict[int, str] = {}

    # ----------------------------------------------------------------- entry points
    def where(self, qualname: str = "") -> str:
        full = ".".join(p for p in (self.path, qualname) if p)
        return full or "<root>"

    def trace_with_spec(self, module: nn.Module, spec: CallSpec) -> fx.Graph:
        self._spec = spec
        self._param_names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        self._buffer_names = {id(b): n for n, b in module.named_buffers(remove_duplicate=False)}
        self._module_names = {id(m): n for n, m in module.named_modules(remove_duplicate=False) if n}
        patches = _ACTIVE["patches"]
        if patches is not None:
            patches.patch_globals(getattr(inspect.unwrap(type(module).forward), "__globals__", None))
        return self.trace(module)

    def trace_to_module(self, module: nn.Module, spec: CallSpec) -> Tuple["TracedModule", Any]:
        """Trace ``module`` called as ``spec`` says; returns the traced module and the example output."""
        try:
            graph = self.trace_with_spec(module, spec)
            output = next(n for n in reversed(graph.nodes) if n.op == "output")
            example_out = self.example_of(output.args[0], strict=False)
            _eliminate_dead_queries(graph)
            with _plain_modules():  # this may run inside the parent's trace
                gm = build_traced_module(module, graph, self)
        except SchedlangError:
            raise
        except Exception as e:
            raise TraceError(f"{self.where()}: cannot trace {type(module).__name__}: {_describe(e)}; keep the "
                             "failing submodule whole with leaf_modules=[...], or pass concrete_args") from e
        if self.specializations:
            logger.debug("%s: specialized on %s", self.where(), "; ".join(self.specializations))
        return gm, example_out

    # ----------------------------------------------------------------- module kinds
    def module_kind(self, m: nn.Module, qualname: str) -> str:
        """'leaf' (a call_module node), 'inline' (traced into this graph) or 'subtrace' (own graph)."""
        sync_op, _ = _sync_op_class()
        full = ".".join(p for p in (self.path, qualname) if p)
        record = module_record(m)
        if (sync_op is not None and isinstance(m, sync_op)) or record.checkpointed or record.fused \
                or "forward" in m.__dict__ or isinstance(m, ModeDependentCall):
            return "leaf"
        if full in self.options.leaf_names or (self.options.leaf_types and isinstance(m, self.options.leaf_types)):
            return "leaf"
        if m._backward_hooks or m._backward_pre_hooks:
            return "leaf"  # autograd hooks on a module cannot be inlined into a graph
        if isinstance(m, _hf_leaf_types()):
            return "leaf"
        if isinstance(m, fx.GraphModule):
            return "inline" if self.options.flatten else "leaf"
        if (m.__module__.startswith(("torch.nn", "torch.ao.nn")) and not isinstance(m, nn.Sequential)):
            return "leaf"
        if not self.options.recursive:
            return "leaf"
        return "inline" if self.options.flatten else "subtrace"

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self.module_kind(m, module_qualified_name) != "inline"

    # ----------------------------------------------------------------- fx hooks
    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        spec = self._spec
        if spec is None:  # plain fx use
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        _reserve_name(self.graph, "self")  # a child named `self` (BERT) must not shadow the module
        call_args: List[Any] = []
        call_kwargs: Dict[str, Any] = {}
        guard_values: Dict[str, Any] = {}
        guard_expected: Dict[str, Any] = {}
        kwargs_proxy = None
        input_keys: List[str] = []
        have_default = False
        for p in spec.params:
            if p.kind is _P.VAR_POSITIONAL:
                examples = tuple(v for _, v in spec.var_args)
                ph = self._placeholder("*" + p.name, examples if spec.var_args else (), None)
                for i, (is_input, v) in enumerate(spec.var_args):
                    call_args.append(ph[i] if is_input else v)
                continue
            if p.kind is _P.VAR_KEYWORD:
                examples = {k: v for k, (is_input, v) in spec.var_kwargs.items()}
                kwargs_proxy = self._placeholder("**" + p.name, examples, None)
                for k, (is_input, v) in spec.var_kwargs.items():
                    if is_input:
                        call_kwargs[k] = kwargs_proxy[k]
                        input_keys.append(k)
                    else:
                        call_kwargs[k] = v
                        guard_expected[k] = _guard_value(v)
                continue
            is_input, value = spec.values[p.name]
            if p.default is not _P.empty and _literal_default(p.default):
                default: Any = (p.default,)
            elif not is_input and _literal_default(value):
                default = (value,)
            elif have_default or not is_input:
                default = (None,)
            else:
                default = None
            have_default = have_default or default is not None
            ph = self._placeholder(p.name, value if is_input else value, default)
            if not is_input:
                guard_values[p.name] = ph
                guard_expected[p.name] = _guard_value(value)
            passed = ph if is_input else value
            # by keyword where possible: HF decorators look keyword arguments up by name
            if p.kind is _P.POSITIONAL_ONLY or (p.kind is _P.POSITIONAL_OR_KEYWORD and spec.var_args):
                call_args.append(passed)
            else:
                call_kwargs[p.name] = passed
        if guard_expected:
            super().create_proxy("call_function", check_specialized_arguments,
                                 (self.where(), guard_values, guard_expected, kwargs_proxy, tuple(input_keys)), {})

        def run_forward(root):
            return root_fn(root, *call_args, **call_kwargs)

        return run_forward, [self.root]

    def _placeholder(self, name: str, example: Any, default: Optional[tuple]) -> fx.Proxy:
        proxy = super().create_proxy("placeholder", name, default or (), {})
        # an input's example may be a meta fake (a captured call of a meta model): on the CPU as every other one
        self.metas[proxy.node] = self._map_examples_safe(example)
        return proxy

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if kind in ("call_function", "call_method") and proxy.node not in self.metas:
            self.metas[proxy.node] = self._compute_example(kind, target, args, kwargs)
        return proxy

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        out = super().getattr(attr, attr_val, parameter_proxy_cache)
        if isinstance(out, fx.Proxy) and out.node not in self.metas:
            self.metas[out.node] = self._fake(attr_val)
        return out

    def create_arg(self, a: Any):
        if isinstance(a, fx.Proxy):
            return a.node
        if isinstance(a, nn.Parameter):
            name = self._param_names.get(id(a))
            return self.create_node("get_attr", name, (), {}) if name else self._constant(a)
        if isinstance(a, torch.Tensor):
            name = self._buffer_names.get(id(a)) or self.tensor_attrs.get(a)
            return self.create_node("get_attr", name, (), {}) if name else self._constant(a)
        if isinstance(a, nn.Module):
            if a is self.root:
                raise TraceError(f"{self.where()}: the module passes itself to a function that is traced into the "
                                 "graph; make that function a leaf (schedlang.graph.register_leaf_function)")
            name = self._module_names.get(id(a))
            return self.create_node("get_attr", name, (), {}) if name else self._constant(a)
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            if not _holds_tensor([getattr(a, f.name, None) for f in dataclasses.fields(a)]):
                return self._constant(a)  # e.g. a model config: the same object, not a rebuilt copy
            # e.g. transformers' ModelOutput: rebuild it in the graph so callers get the same type
            fields = {f.name: self.create_arg(getattr(a, f.name)) for f in dataclasses.fields(a) if f.init}
            return self.create_node("call_function", type(a), (), fields)
        try:
            return super().create_arg(a)
        except NotImplementedError:
            return self._constant(a)

    def _constant(self, value: Any) -> fx.Node:
        name = self._constant_ids.get(id(value))
        if name is None:
            name = f"_schedlang_const_{len(self.constants)}"
            self.constants[name] = value
            self._constant_ids[id(value)] = name
        node = self.create_node("get_attr", name, (), {})
        self.metas[node] = self._fake(value)
        return node

    # control flow, answered by example values
    def to_bool(self, obj: fx.Proxy) -> bool:
        example = self._example_or_fail(obj, "used as a condition (if / and / or / not / assert)")
        try:
            value = bool(example)
        except Exception as e:
            raise TraceError(
                f"{self.where()}: the condition '{_describe_node(obj.node)}' depends on tensor data, which symbolic "
                f"tracing cannot know; mark the module as a leaf (leaf_modules=[...]) or make the function a leaf "
                f"(schedlang.graph.register_leaf_function) ({_describe(e)})") from e
        self.specializations.append(f"bool({obj.node.name}) = {value}")
        # the other branch is not in the graph: refuse inputs that would take it (a Python bool or int here,
        # from shapes, dtypes or specialized values: checking it costs no device sync)
        self.create_node("call_function", check_traced_condition,
                         (obj.node, value, self.where(), _expression(obj.node)), {})
        return value

    def iter(self, obj: fx.Proxy):
        example = self._example_or_fail(obj, "iterated over (for / * unpacking)")
        if isinstance(example, dict):
            return iter(list(example.keys()))
        n = self._length(obj, example)
        return iter([obj[i] for i in range(n)])

    def keys(self, obj: fx.Proxy):
        example = self._example_or_fail(obj, "unpacked with **")
        if not isinstance(example, dict):
            raise TraceError(f"{self.where()}: '{obj.node.name}' is unpacked with ** but is not a dict; "
                               "only a dict can be unpacked with **")
        return list(example.keys())

    def len_of(self, obj: fx.Proxy) -> int:
        return self._length(obj, self._example_or_fail(obj, "passed to len()"))

    def _length(self, obj, example) -> int:
        if isinstance(example, torch.Tensor):
            if example.dim() == 0:
                raise TraceError(f"{self.where()}: '{obj.node.name}' is a 0-d tensor and has no length; "
                                 "len() needs a tensor of at least one dimension")
            n = int(example.shape[0])
        else:
            n = len(example)
        self.specializations.append(f"len({obj.node.name}) = {n}")
        if not isinstance(example, torch.Size):  # a shape's length is the rank: ops on a wrong rank fail by themselves
            self.create_node("call_function", check_traced_length, (obj.node, n, self.where(), _expression(obj.node)),
                             {})
        return n

    def _example_or_fail(self, obj: fx.Proxy, how: str) -> Any:
        example = self.metas.get(obj.node, UNKNOWN)
        if example is UNKNOWN:
            # name the forward's own inputs that have no example, so the hint can be copied as it is
            missing = [str(n.target) for n in obj.node.graph.nodes if n.op == "placeholder"
                       and not str(n.target).startswith("*") and self.metas.get(n, UNKNOWN) is UNKNOWN]
            inputs = ", ".join(repr(name) for name in missing) or "the inputs"
            hint = f"concrete_args={{{missing[0]!r}: <example tensor>}}" if missing else \
                "concrete_args={'<input name>': <example tensor>}"
            raise TraceError(
                f"{self.where()}: '{_describe_node(obj.node)}' is {how}, so its value must be known while tracing, "
                f"but no example input reaches it; pass example tensors for {inputs} in concrete_args "
                f"(e.g. {hint}), specialize the argument, or keep the module as a leaf (leaf_modules=[...])")
        return example

    # ----------------------------------------------------------------- module calls
    def call_module(self, m: nn.Module, forward: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
        if m is not self.root and id(m) not in self._module_names:
            return self._call_foreign_module(m, args, kwargs)
        qualname = self.path_of_module(m)
        kind = self.module_kind(m, qualname)
        if kind == "leaf":
            proxy = super().create_proxy("call_module", qualname, args, kwargs)
            self.metas[proxy.node] = self._leaf_module_example(m, args, kwargs)
            return proxy
        if kind == "subtrace":
            return self._subtrace(m, qualname, args, kwargs)
        patches = _ACTIVE["patches"]
        if patches is not None:
            patches.patch_globals(getattr(inspect.unwrap(type(m).forward), "__globals__", None))
        return super().call_module(m, self._inline_forward(m), args, kwargs)

    def _call_foreign_module(self, m: nn.Module, args: Tuple, kwargs: Dict[str, Any]) -> Any:
        """A module this forward calls but does not own (see :mod:`.foreign_modules`): its operations go into
        the graph when its forward traces; it stays one opaque call when it holds state, when the same rules
        that keep an owned module whole say so, or when its forward does not trace."""
        if not self._keep_foreign_whole(m):
            mark, specialized = GraphMark(self.graph), len(self.specializations)
            try:
                return self._trace_through_foreign(m, mark, args, kwargs)
            except Exception as e:
                mark.rewind(self.metas)
                del self.specializations[specialized:]
                logger.debug("%s: %s is no submodule and is not traced through (%s); it is called as one node",
                             self.where(), type(m).__qualname__, _describe(e))
        call = OpaqueModuleCall(m)
        with self._cpu_fakes_for_meta_tensors(m):
            # UNKNOWN where it branches on data, as for a leaf module: only a later use that needs it fails
            example = self._compute_example("call_function", call, args, kwargs)
        proxy = super().create_proxy("call_function", call, args, kwargs)
        self.metas[proxy.node] = example
        return proxy

    def _trace_through_foreign(self, m: nn.Module, mark: GraphMark, args: Tuple, kwargs: Dict[str, Any]) -> Any:
        """Trace ``m``'s forward into this graph, after a first trace in the other training mode. ``train()`` and
        ``eval()`` of the traced module never reach a module it does not own, so a graph that froze such a module's
        mode could not follow it as eager does: a forward whose operations depend on the mode raises here."""
        patches = _ACTIVE["patches"]
        if patches is not None:
            patches.patch_globals(getattr(inspect.unwrap(type(m).forward), "__globals__", None))
        with _flipped_mode(m):
            self._inline_forward(m)(*args, **kwargs)
        in_other_mode = node_codes(mark.nodes_after())
        mark.rewind(self.metas)
        out = self._inline_forward(m)(*args, **kwargs)
        if node_codes(mark.nodes_after()) != in_other_mode:
            raise TraceError(f"{self.where()}: the operations of {type(m).__qualname__} depend on its training "
                             f"mode; it is called as one opaque function instead")
        return out

    def _keep_foreign_whole(self, m: nn.Module) -> bool:
        """Whether a module this forward does not own is called as one node without trying its forward: it
        holds state, or it is one that an owned module would be kept whole for (a sync op, checkpointed or
        fused, an instance-level forward such as a kernel put in place, autograd hooks, a leaf type).
        ``recursive=False`` and torch.nn's own classes do not count: those keep an owned module a
        ``call_module`` node, which a module without a path cannot be, and its operations serve ``find`` and
        ``fuse`` better than an opaque call."""
        sync_op, _ = _sync_op_class()
        record = module_record(m)
        return (owns_state(m) or (sync_op is not None and isinstance(m, sync_op)) or record.checkpointed
                or record.fused or "forward" in m.__dict__ or isinstance(m, ModeDependentCall)
                or bool(m._backward_hooks or m._backward_pre_hooks) or isinstance(m, _hf_leaf_types())
                or bool(self.options.leaf_types and isinstance(m, self.options.leaf_types)))

    def _inline_forward(self, m: nn.Module) -> Callable:
        """``m.__call__`` with its forward hooks, where schedlang's sync hooks accept proxies."""
        _, sync_hook = _sync_op_class()

        def run(*args, **kwargs):
            for key, hook in list(m._forward_pre_hooks.items()):
                if sync_hook is not None and isinstance(hook, sync_hook):
                    args = self._sync_input(m, hook, args)
                    continue
                if key in m._forward_pre_hooks_with_kwargs:
                    res = hook(m, args, kwargs)
                    if res is not None:
                        args, kwargs = res
                else:
                    res = hook(m, args)
                    if res is not None:
                        args = res if isinstance(res, tuple) else (res,)
            out = m.forward(*args, **kwargs)
            for key, hook in list(m._forward_hooks.items()):
                if sync_hook is not None and isinstance(hook, sync_hook):
                    out = self._sync_output(m, hook, out)
                    continue
                res = hook(m, args, kwargs, out) if key in m._forward_hooks_with_kwargs else hook(m, args, out)
                if res is not None:
                    out = res
            return out

        return run

    @staticmethod
    def _sync_input(m, hook, args):
        for i, a in enumerate(args):
            if isinstance(a, (torch.Tensor, fx.Proxy)):
                return args[:i] + (getattr(m, hook.child_name)(a),) + args[i + 1:]
        raise TraceError(f"{type(m).__name__}: {hook.mode} sync needs a positional tensor input")

    def _sync_output(self, m, hook, out):
        sync = getattr(m, hook.child_name)
        example = self.metas.get(out.node, UNKNOWN) if isinstance(out, fx.Proxy) else out
        if isinstance(out, torch.Tensor) or isinstance(example, torch.Tensor):
            return sync(out)
        if isinstance(out, (tuple, list)) or isinstance(example, (tuple, list)):
            return (sync(out[0]),) + tuple(out[i] for i in range(1, len(out)))
        raise TraceError(f"{type(m).__name__}: fwd_post sync found no tensor output; a fwd_post sync needs a "
                     "module that returns a tensor")

    def _subtrace(self, m: nn.Module, qualname: str, args, kwargs) -> fx.Proxy:
        spec = CallSpec.from_call(m, args, kwargs, lambda v: self.example_of(v, strict=False))
        entry = self.children.get(qualname)
        if entry is None:
            child_tracer = type(self)(self.options, path=".".join(p for p in (self.path, qualname) if p))
            child_gm, example_out = child_tracer.trace_to_module(m, spec)
            self.children[qualname] = (child_gm, spec.key())
        else:
            child_gm, key = entry
            if key != spec.key():
                raise TraceError(
                    f"{self.where(qualname)}: the module is called more than once with different non-tensor "
                    "arguments, so one graph cannot serve every call; keep it as a leaf (leaf_modules=[...]) or "
                    "trace with flatten=True")
            example_out = self._run_example(lambda *a, **k: child_gm.forward(*a, **k), args, kwargs)
        proxy = super().create_proxy("call_module", qualname, args, kwargs)
        self.metas[proxy.node] = example_out
        return proxy

    # ----------------------------------------------------------------- leaf functions
    def record_leaf_call(self, fn: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
        example = self._compute_example("call_function", fn, args, kwargs)

        def snapshot(v):
            return ModuleAttributes(v) if isinstance(v, nn.Module) else v

        node_args = tuple(snapshot(a) for a in args)
        node_kwargs = {k: snapshot(v) for k, v in kwargs.items()}
        if isinstance(example, torch.Tensor):
            node_kwargs.update(_keep_mask_flags(fn, args, kwargs))
        if example is not UNKNOWN and not _holds_tensor(example):
            # a mask builder that returns None for these shapes: later `mask is None` tests must see None
            self.specializations.append(f"{getattr(fn, '__name__', fn)}(...) = {example!r}")
            return example
        proxy = super().create_proxy("call_function", fn, node_args, node_kwargs)
        self.metas[proxy.node] = example
        if isinstance(example, tuple) and not hasattr(example, "_fields"):
            # (output, None): keep the non-tensor parts as constants so `weights is None` stays true
            return tuple(proxy[i] if _holds_tensor(v) else v for i, v in enumerate(example))
        return proxy



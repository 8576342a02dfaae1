"""Hierarchy-keeping FX tracing that works on transformers 5.x models.

``trace_module(module)`` turns ``module`` into a :class:`TracedModule` (an
``fx.GraphModule``). By default every traced child becomes its own ``TracedModule`` at the
same path, so ``sch["layers.0.mlp"]`` still names the MLP after its parent was traced;
``flatten=True`` inlines the children into one graph instead. Leaf modules (``torch.nn``
built-ins, schedlang's sync ops, checkpointed modules, fused kernels, HF ``Conv1D`` and the
types or names given in ``leaf_modules``) stay ``call_module`` nodes.

How models with Python control flow are traced
-----------------------------------------------
HF models branch on shapes (``if q_len > 1``), unpack shapes (``(*x.shape[:-1], -1, d)``)
and build masks with data-dependent shortcuts. Plain ``torch.fx.symbolic_trace`` fails on
all three. This tracer keeps shapes symbolic in the graph but also carries an *example
value* for every node: a ``FakeTensor`` (shape, dtype, device, no data) computed by running
each operation under ``FakeTensorMode``. When Python needs a concrete answer (``bool``,
``len``, iteration), the example answers it, and the graph is *specialized* on that answer
(logged at DEBUG level). Examples come from

* tensors given in ``concrete_args`` (an example input: the argument stays a graph input);
* a synthesized ``input_ids`` of shape (2, 8) for an HF model (``main_input_name``);
* for a submodule of an HF model traced on its own, the arguments it really receives:
  the enclosing model runs once under ``FakeTensorMode`` and the call is recorded
  (:func:`capture_call`); tensor arguments become inputs, the rest is specialized;
* the call as recorded while tracing the parent, for every traced child.

Arguments of the traced ``forward`` that are not inputs are *specialized*: their value is
baked into the graph and a guard in the generated code raises :class:`TraceError` if the
module is later called with a different one. By default the inputs are the parameters
without a default plus an HF model's main input; every other parameter keeps its default,
with ``use_cache=False`` (no KV cache: the graph is a training / prefill graph). Pass
``concrete_args={"attention_mask": PH}`` to make an optional argument an input.

Functions that cannot be traced symbolically are recorded as one ``call_function`` node
(:func:`register_leaf_function`): HF's mask builders (``create_causal_mask`` ...) and the
registered attention kernels (``sdpa_attention_forward`` ...; ``eager_attention_forward``
is traced through, so its matmul/softmax are visible). A module passed to a leaf function
is replaced by a snapshot of its plain attributes (:class:`ModuleAttributes`).

What survives tracing: parameters and buffers (same objects, same qualified names, even
those the graph does not use), ``_schedlang_*`` attributes such as shard records, sync-op
children and the forward hooks of every module that is replaced by a ``TracedModule``,
container types (``ModuleList``), non-persistent buffers, and the plain attributes of the
original module (``config``, ...). ``self.training`` and the Python values of the
arguments are frozen at trace time (e.g. functional dropout's ``training`` flag).

Example::

    gm = trace_module(model.layers[0].mlp)
    print(gm.code)
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import operator
import sys
import threading
import types
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx
from torch import nn
from torch.fx import PH

from ..errors import SchedlangError, TraceError

__all__ = [
    "PH",
    "TracedModule",
    "ModuleAttributes",
    "SchedlangTracer",
    "CallSpec",
    "trace_module",
    "capture_call",
    "register_leaf_function",
    "check_specialized_arguments",
]

logger = logging.getLogger("schedlang.graph.tracer")

_P = inspect.Parameter
_LITERALS = (type(None), bool, int, float, str)


class _Unknown:
    """Example value that could not be computed."""

    def __repr__(self) -> str:
        return "<unknown>"


UNKNOWN = _Unknown()


class _NeedsExample(Exception):
    """Raised internally when an example value is needed but unknown."""


# ---------------------------------------------------------------------------------------------
# leaf functions
# ---------------------------------------------------------------------------------------------

_LEAF_FUNCTIONS: Dict[int, Callable] = {}
_LEAF_WRAPPERS: Dict[int, Callable] = {}

# HF mask builders: they branch on tensor data and build masks with vmap; one node each.
_HF_MASK_FUNCTIONS = (
    "create_causal_mask",
    "create_sliding_window_causal_mask",
    "create_bidirectional_mask",
    "create_bidirectional_sliding_window_mask",
    "create_chunked_causal_mask",
    "create_masks_for_generate",
)


def register_leaf_function(fn: Callable) -> Callable:
    """Record calls of ``fn`` as one ``call_function`` node instead of tracing into it.

    Use it for functions with data-dependent Python control flow. Works as a decorator;
    calls are intercepted through the module-level name the caller uses, as in
    ``torch.fx.wrap``. Example::

        @register_leaf_function
        def clamp_to_mask(x, mask):
            return x if mask is None or bool(mask.all()) else x * mask
    """
    if not callable(fn):
        raise TypeError(f"register_leaf_function expects a function, got {type(fn).__name__}")
    _LEAF_FUNCTIONS[id(fn)] = fn
    return fn


def _leaf_wrapper(fn: Callable) -> Callable:
    wrapper = _LEAF_WRAPPERS.get(id(fn))
    if wrapper is not None:
        return wrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tracer = _tracer_of((args, kwargs))
        if tracer is None:
            return fn(*args, **kwargs)
        return tracer.record_leaf_call(fn, args, kwargs)

    wrapper.__schedlang_leaf_of__ = fn
    _LEAF_WRAPPERS[id(fn)] = wrapper
    return wrapper


def _tracer_of(tree: Any) -> Optional["SchedlangTracer"]:
    for leaf in torch.utils._pytree.tree_leaves(tree):
        if isinstance(leaf, fx.Proxy) and isinstance(leaf.tracer, SchedlangTracer):
            return leaf.tracer
    return None


def _default_leaf_functions() -> List[Callable]:
    fns = []
    masking = sys.modules.get("transformers.masking_utils")
    if masking is not None:
        fns += [getattr(masking, n) for n in _HF_MASK_FUNCTIONS if callable(getattr(masking, n, None))]
    # the registered attention kernels decide `is_causal` from `mask is None` at run time (HF
    # drops an all-ones mask), so they must run as one call, also when a traced graph that
    # calls them by name is traced again
    interface = getattr(sys.modules.get("transformers.modeling_utils"), "AttentionInterface", None)
    mapping = getattr(interface, "_global_mapping", None)
    if isinstance(mapping, dict):
        fns += [fn for fn in mapping.values() if callable(fn)]
    return fns


# ---------------------------------------------------------------------------------------------
# specialization guard (runs inside generated code)
# ---------------------------------------------------------------------------------------------


def check_specialized_arguments(where: str, values: Dict[str, Any], expected: Dict[str, Any],
                                extra_kwargs: Optional[Dict[str, Any]] = None,
                                input_keys: Sequence[str] = ()) -> None:
    """Raise :class:`TraceError` if an argument that was specialized at trace time changed.

    ``expected`` maps names to the traced value; ``"<object>"`` stands for a value that has
    no literal form and accepts any non-tensor. ``None`` at call time is always accepted
    (it means "the default"); a different literal, or a tensor where the trace saw a
    non-tensor, is refused. Extra keyword arguments that were not traced must be None/False.
    """
    extra_kwargs = extra_kwargs or {}
    for name, want in expected.items():
        got = values[name] if name in values else extra_kwargs.get(name)
        if got is None:
            continue
        if isinstance(want, str) and want == "<object>":
            if isinstance(got, torch.Tensor):
                _specialization_failed(where, name, want, got)
            continue
        if not _same_literal(got, want):
            _specialization_failed(where, name, want, got)
    for name, got in extra_kwargs.items():
        if name in expected or name in input_keys or got is None or got is False:
            continue
        _specialization_failed(where, name, "<not passed>", got)


def _same_literal(got: Any, want: Any) -> bool:
    if isinstance(got, torch.Tensor):
        return False
    try:
        same = got == want
    except Exception:
        return False
    return same is True


def _specialization_failed(where, name, want, got) -> None:
    shown = f"a tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else repr(got)
    raise TraceError(
        f"{where}: the graph was traced with {name}={want!r} and cannot take {name}={shown}; trace the module "
        f"again with concrete_args={{'{name}': ...}} (a value to specialize on, or schedlang.graph.PH to make it "
        "a graph input)")


try:  # keep the guard through dead-code elimination
    from torch.fx.node import has_side_effect as _has_side_effect

    _has_side_effect(check_specialized_arguments)
except ImportError:  # pragma: no cover - old torch
    pass

register_leaf_function(check_specialized_arguments)


# ---------------------------------------------------------------------------------------------
# values stored in graphs
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# the call a traced forward is specialized on
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CallSpec:
    """How one ``forward`` is traced: which parameters are graph inputs (with an example
    value, or :data:`UNKNOWN`) and which are specialized constants."""

    params: List[inspect.Parameter]
    values: Dict[str, Tuple[bool, Any]]
    var_args: List[Tuple[bool, Any]] = dataclasses.field(default_factory=list)
    var_kwargs: Dict[str, Tuple[bool, Any]] = dataclasses.field(default_factory=dict)

    def input_names(self) -> List[str]:
        return [n for n, (is_input, _) in self.values.items() if is_input]

    def key(self):
        """What two calls must share to use the same traced graph."""
        def k(entry):
            is_input, v = entry
            return ("input",) if is_input else ("const", _constant_key(v))

        return (tuple((n, k(e)) for n, e in self.values.items()), tuple(k(e) for e in self.var_args),
                tuple(sorted((n, k(e)) for n, e in self.var_kwargs.items())))

    @classmethod
    def from_call(cls, module: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any],
                  example_of: Callable[[Any], Any]) -> "CallSpec":
        """Spec of one recorded call: values holding tensors or proxies become inputs."""
        params = forward_parameters(module)
        sig = inspect.Signature(params)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TraceError(f"{type(module).__name__}.forward{sig} cannot take the arguments it was called with: "
                             f"{e}") from e
        bound.apply_defaults()
        spec = cls(params=params, values={})
        for p in params:
            value = bound.arguments.get(p.name)
            if p.kind is _P.VAR_POSITIONAL:
                spec.var_args = [(_holds_tensor(v), example_of(v) if _holds_tensor(v) else v) for v in value or ()]
            elif p.kind is _P.VAR_KEYWORD:
                spec.var_kwargs = {k: (_holds_tensor(v), example_of(v) if _holds_tensor(v) else v)
                                   for k, v in (value or {}).items()}
            else:
                spec.values[p.name] = (True, example_of(value)) if _holds_tensor(value) else (False, value)
        return spec

    @classmethod
    def from_signature(cls, module: nn.Module, concrete_args: Optional[Dict[str, Any]] = None,
                       make_example: Optional[Callable[[torch.Tensor], Any]] = None) -> "CallSpec":
        """Spec from ``forward``'s signature (see the module docstring for the policy)."""
        concrete_args = dict(concrete_args or {})
        make_example = make_example or (lambda t: t)
        params = forward_parameters(module)
        names = {p.name for p in params if p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)}
        main_inputs = set(getattr(module, "_schedlang_input_names", ()) or ())
        main = getattr(module, "main_input_name", None)
        if isinstance(main, str):
            main_inputs.add(main)
        spec = cls(params=params, values={})

        def given(value):
            if value is PH or isinstance(value, fx._symbolic_trace.PHBase):
                return True, UNKNOWN
            if isinstance(value, torch.Tensor):
                return True, make_example(value)
            return False, value

        for p in params:
            if p.kind is _P.VAR_POSITIONAL:
                continue
            if p.kind is _P.VAR_KEYWORD:
                spec.var_kwargs = {k: given(v) for k, v in concrete_args.items() if k not in names}
                continue
            if p.name in concrete_args:
                is_input, example = given(concrete_args[p.name])
                if is_input and example is UNKNOWN:
                    example = _synthesize_example(module, p.name, make_example)
                spec.values[p.name] = (is_input, example)
            elif p.default is _P.empty or p.name in main_inputs:
                spec.values[p.name] = (True, _synthesize_example(module, p.name, make_example))
            elif p.name in _RUNTIME_FLAG_DEFAULTS and p.default is None:
                spec.values[p.name] = (False, _RUNTIME_FLAG_DEFAULTS[p.name])
            else:
                spec.values[p.name] = (False, p.default)
        return spec


# flags HF models read from the config when they are None: trace without a KV cache
_RUNTIME_FLAG_DEFAULTS = {"use_cache": False, "output_attentions": False, "output_hidden_states": False}

# shape of the example input synthesized for an HF model: batch 2 and sequence 8 take the
# general branches (no broadcasting over batch 1, no single-token decoding path)
EXAMPLE_BATCH, EXAMPLE_SEQUENCE = 2, 8


def _synthesize_example(module: nn.Module, name: str, make_example) -> Any:
    """Example for an HF model's token-level inputs: (batch, sequence) integer tensors."""
    config = getattr(module, "config", None)
    if name not in _HF_TOKEN_INPUTS or config is None or not getattr(config, "vocab_size", None):
        return UNKNOWN
    device = _module_device(module)
    if device.type == "meta":
        device = torch.device("cpu")
    shape = (EXAMPLE_BATCH, EXAMPLE_SEQUENCE)
    if name == "position_ids":
        return make_example(torch.arange(EXAMPLE_SEQUENCE, device=device).expand(shape))
    fill = 1 if name == "attention_mask" else 0
    return make_example(torch.full(shape, fill, dtype=torch.long, device=device))


_HF_TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")


def _module_device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def forward_parameters(module: nn.Module) -> List[inspect.Parameter]:
    """Parameters of ``type(module).forward`` (decorators unwrapped), without ``self``."""
    fn = inspect.unwrap(type(module).forward)
    params = list(inspect.signature(fn).parameters.values())
    return params[1:]


def _holds_tensor(value: Any) -> bool:
    return any(isinstance(v, (torch.Tensor, fx.Proxy)) for v in _leaves(value))


def _leaves(value: Any) -> Iterable[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, slice):
        yield from _leaves((value.start, value.stop, value.step))
    else:
        yield value


def _constant_key(v: Any):
    if isinstance(v, _LITERALS):
        return (type(v).__name__, v)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_constant_key(x) for x in v))
    if isinstance(v, (torch.dtype, torch.device)):
        return ("torch", str(v))
    return ("object", id(v))


def _literal_default(value: Any) -> bool:
    if isinstance(value, _LITERALS):
        return not isinstance(value, float) or value == value  # NaN has no repr that round-trips
    if isinstance(value, tuple):
        return all(_literal_default(v) for v in value)
    return False


# ---------------------------------------------------------------------------------------------
# patches active while tracing
# ---------------------------------------------------------------------------------------------


class _Patches:
    """Global patches (leaf-function wrappers, attention registry, Proxy.__len__), undone at exit."""

    def __init__(self):
        self.undo: List[Tuple[Any, str, Any, bool]] = []
        self.seen: Set[int] = set()
        self.leaf_ids: Dict[int, Callable] = {}

    def refresh_leaf_ids(self) -> None:
        self.leaf_ids = dict(_LEAF_FUNCTIONS)
        for fn in _default_leaf_functions():
            self.leaf_ids[id(fn)] = fn

    def patch_globals(self, namespace: Optional[dict]) -> None:
        if namespace is None or id(namespace) in self.seen:
            return
        self.seen.add(id(namespace))
        for name, value in list(namespace.items()):
            fn = self.leaf_ids.get(id(value))
            if fn is not None and fn is value:
                self.undo.append((namespace, name, value, True))
                namespace[name] = _leaf_wrapper(fn)

    def patch_attr(self, owner: Any, name: str, value: Any) -> None:
        had = name in owner.__dict__
        self.undo.append((owner, name, owner.__dict__.get(name), had))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, old, had in reversed(self.undo):
            if isinstance(owner, dict):
                owner[name] = old
            elif had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self.undo.clear()
        self.seen.clear()


_PATCH_LOCK = threading.RLock()
_ACTIVE: Dict[str, Any] = {"patches": None, "depth": 0}


def _proxy_len(self):
    if isinstance(self.tracer, SchedlangTracer):
        return self.tracer.len_of(self)
    return _ORIGINAL_PROXY_LEN(self)


_ORIGINAL_PROXY_LEN = fx.Proxy.__len__
_ORIGINAL_PROXY_GETATTR = fx.Proxy.__getattr__


def _proxy_getattr(self, name):
    # a proxy answers every attribute, so duck-typing probes in user code (``hasattr(x, "jax")``,
    # ``hasattr(x, "numpy")`` in framework-detection helpers) would take the wrong branch; a proxy
    # whose example is a tensor has exactly the tensor's attributes
    tracer = self.__dict__.get("tracer")
    if isinstance(tracer, SchedlangTracer):
        example = tracer.metas.get(self.node, UNKNOWN)
        if isinstance(example, torch.Tensor) and not hasattr(example, name):
            raise AttributeError(f"'{type(example).__name__}' object has no attribute '{name}'")
    return _ORIGINAL_PROXY_GETATTR(self, name)


@contextlib.contextmanager
def _tracing_patches(root: nn.Module):
    with _PATCH_LOCK:
        outer = _ACTIVE["patches"] is None
        if outer:
            patches = _Patches()
            patches.refresh_leaf_ids()
            patches.patch_attr(fx.Proxy, "__len__", _proxy_len)
            patches.patch_attr(fx.Proxy, "__getattr__", _proxy_getattr)
            modeling_utils = sys.modules.get("transformers.modeling_utils")
            interface = getattr(modeling_utils, "AttentionInterface", None)
            if interface is not None:
                original_getitem = interface.__getitem__

                def getitem(self, key, _orig=original_getitem):
                    fn = _orig(self, key)
                    return _leaf_wrapper(fn) if callable(fn) else fn

                patches.patch_attr(interface, "__getitem__", getitem)
            _ACTIVE["patches"] = patches
        patches = _ACTIVE["patches"]
        _ACTIVE["depth"] += 1
        try:
            for m in root.modules():
                mod = sys.modules.get(type(m).__module__)
                patches.patch_globals(getattr(mod, "__dict__", None))
            for fn in list(patches.leaf_ids.values()):
                mod = sys.modules.get(getattr(fn, "__module__", "") or "")
                patches.patch_globals(getattr(mod, "__dict__", None))
            yield patches
        finally:
            _ACTIVE["depth"] -= 1
            if outer:
                _ACTIVE["patches"] = None
                patches.restore()


# ---------------------------------------------------------------------------------------------
# the tracer
# ---------------------------------------------------------------------------------------------


def _sync_op_class():
    mod = sys.modules.get("schedlang.distributed.sync_ops")
    if mod is None:
        try:
            from ..distributed import sync_ops as mod
        except ImportError:  # pragma: no cover
            return None, None
    return getattr(mod, "SyncOp", None), getattr(mod, "SyncHook", None)


def _hf_leaf_types() -> Tuple[type, ...]:
    types_ = []
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(pytorch_utils, "Conv1D", None)
    if isinstance(conv1d, type):
        types_.append(conv1d)  # has its own shard rule: keep it a module
    return tuple(types_)


@dataclasses.dataclass
class _Options:
    recursive: bool
    flatten: bool
    leaf_types: Tuple[type, ...]
    leaf_names: Set[str]
    fake_mode: Any


class SchedlangTracer(fx.Tracer):
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
            raise TraceError(f"{self.where()}: cannot trace {type(module).__name__}: {_describe(e)}") from e
        if self.specializations:
            logger.debug("%s: specialized on %s", self.where(), "; ".join(self.specializations))
        return gm, example_out

    # ----------------------------------------------------------------- module kinds
    def module_kind(self, m: nn.Module, qualname: str) -> str:
        """'leaf' (a call_module node), 'inline' (traced into this graph) or 'subtrace' (own graph)."""
        sync_op, _ = _sync_op_class()
        full = ".".join(p for p in (self.path, qualname) if p)
        if (sync_op is not None and isinstance(m, sync_op)) or getattr(m, "_schedlang_checkpointed", False) \
                or getattr(m, "_schedlang_fused", False) or "forward" in m.__dict__:
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
        self.metas[proxy.node] = example
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
            raise TraceError(f"{self.where()}: '{obj.node.name}' is unpacked with ** but is not a dict")
        return list(example.keys())

    def len_of(self, obj: fx.Proxy) -> int:
        return self._length(obj, self._example_or_fail(obj, "passed to len()"))

    def _length(self, obj, example) -> int:
        if isinstance(example, torch.Tensor):
            if example.dim() == 0:
                raise TraceError(f"{self.where()}: '{obj.node.name}' is a 0-d tensor and has no length")
            n = int(example.shape[0])
        else:
            n = len(example)
        self.specializations.append(f"len({obj.node.name}) = {n}")
        return n

    def _example_or_fail(self, obj: fx.Proxy, how: str) -> Any:
        example = self.metas.get(obj.node, UNKNOWN)
        if example is UNKNOWN:
            raise TraceError(
                f"{self.where()}: '{_describe_node(obj.node)}' is {how}, so its value must be known while tracing, "
                "but no example input reaches it; pass example tensors for the inputs in concrete_args "
                "(e.g. concrete_args={'hidden_states': torch.randn(2, 8, 64)}), specialize the argument, or keep "
                "the module as a leaf (leaf_modules=[...])")
        return example

    # ----------------------------------------------------------------- module calls
    def call_module(self, m: nn.Module, forward: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
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
        raise TraceError(f"{type(m).__name__}: fwd_post sync found no tensor output")

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

    # ----------------------------------------------------------------- example values
    @property
    def fake_mode(self):
        return self.options.fake_mode

    def _fake(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not _is_fake(value):
            try:
                return self.fake_mode.from_tensor(value)
            except Exception:  # pragma: no cover - exotic tensor subclasses
                return UNKNOWN
        return value

    def example_of(self, value: Any, strict: bool = True) -> Any:
        """Example value of a proxy / node / nested structure (UNKNOWN if not computable)."""
        try:
            return self._map_examples(value)
        except _NeedsExample:
            if strict:
                raise
            return UNKNOWN

    def _map_examples(self, value: Any) -> Any:
        if isinstance(value, fx.Proxy):
            value = value.node
        if isinstance(value, fx.Node):
            example = self.metas.get(value, UNKNOWN)
            if example is UNKNOWN:
                raise _NeedsExample()
            return example
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*[self._map_examples(v) for v in value])
        if isinstance(value, (list, tuple)):
            return type(value)(self._map_examples(v) for v in value)
        if isinstance(value, dict) and type(value) is dict:
            return {k: self._map_examples(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(self._map_examples(value.start), self._map_examples(value.stop),
                         self._map_examples(value.step))
        if isinstance(value, torch.Tensor):
            return self._fake(value)
        return value

    def _run_example(self, fn: Callable, args, kwargs) -> Any:
        try:
            ex_args = self._map_examples(tuple(args))
            ex_kwargs = self._map_examples(dict(kwargs))
        except _NeedsExample:
            return UNKNOWN
        try:
            with _plain_modules(), self.fake_mode:
                return fn(*ex_args, **ex_kwargs)
        except Exception as e:  # an example is a convenience: tracing goes on without it
            logger.debug("%s: no example value for %s: %s", self.where(), getattr(fn, "__name__", fn), _describe(e))
            return UNKNOWN

    def _compute_example(self, kind: str, target: Any, args, kwargs) -> Any:
        if kind == "call_method":
            def fn(obj, *rest, **kw):
                return getattr(obj, target)(*rest, **kw)
        else:
            fn = target
        return self._run_example(fn, args, kwargs)

    def _leaf_module_example(self, m: nn.Module, args, kwargs) -> Any:
        sync_op, sync_hook = _sync_op_class()
        if sync_op is not None and isinstance(m, sync_op):
            return self._run_example(lambda x: _shape_only_sync_forward(m, x), args[:1], {})
        forward = type(m).forward
        example = self._run_example(lambda *a, **k: forward(m, *a, **k), args, kwargs)
        if sync_hook is not None and example is not UNKNOWN:
            for hook in m._forward_hooks.values():
                if isinstance(hook, sync_hook):
                    sync = m._modules.get(hook.child_name)
                    if isinstance(example, torch.Tensor):
                        example = self._run_example(lambda x: _shape_only_sync_forward(sync, x), (example,), {})
                    elif isinstance(example, tuple) and example:
                        first = self._run_example(lambda x: _shape_only_sync_forward(sync, x), (example[0],), {})
                        example = (first,) + example[1:]
        return example


@contextlib.contextmanager
def _plain_modules():
    """Undo FX's tracing patches of ``nn.Module`` while computing an example value, so that
    running a module on fake tensors does not record graph nodes."""
    patched_getattr, patched_call = nn.Module.__getattr__, nn.Module.__call__
    nn.Module.__getattr__ = fx._symbolic_trace._orig_module_getattr
    nn.Module.__call__ = fx._symbolic_trace._orig_module_call
    try:
        with _shape_only_syncs():
            yield
    finally:
        nn.Module.__getattr__, nn.Module.__call__ = patched_getattr, patched_call


def _shape_only_sync_forward(self, x):
    """SyncOp.forward for example values: the output shape, no communication."""
    if not isinstance(x, torch.Tensor) or callable(self.op) or self.mode == "bwd_post" or self.op == "all_reduce":
        return x
    from ..distributed.groups import world_size

    n = world_size(self.group)
    if self.op == "all_gather":
        return torch.cat([x] * n, dim=self.axis)
    return x.narrow(self.axis, 0, x.shape[self.axis] // n)


@contextlib.contextmanager
def _shape_only_syncs():
    """While example values are computed, sync ops return the right shape without a collective."""
    sync_op, _ = _sync_op_class()
    if sync_op is None or sync_op.__dict__.get("forward") is _shape_only_sync_forward:
        yield
        return
    original = sync_op.__dict__["forward"]
    sync_op.forward = _shape_only_sync_forward
    try:
        yield
    finally:
        sync_op.forward = original


_MASK_SKIP_FLAGS = ("allow_is_causal_skip", "allow_is_bidirectional_skip")


def _keep_mask_flags(fn: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Keyword arguments that stop an HF mask builder from returning None at run time.

    On fake tensors HF always builds the mask; on real ones it returns None for an all-ones
    padding mask. The attention kernels that are leaf functions handle both, but eager
    attention is traced through and was specialized on a tensor mask, so for it the mask
    must always be built.
    """
    config = kwargs.get("config", args[0] if args else None)
    if getattr(config, "_attn_implementation", None) != "eager":
        return {}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    return {flag: False for flag in _MASK_SKIP_FLAGS if flag in params and flag not in kwargs}


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _describe_node(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    args = ", ".join(str(a) for a in node.args)
    return f"{node.name} = {target}({args})" if node.op != "placeholder" else node.name


def _reserve_name(graph: fx.Graph, name: str) -> None:
    namespace = getattr(graph, "_graph_namespace", None)
    if namespace is not None and hasattr(namespace, "create_name"):
        namespace.create_name(name, None)


def _guard_value(value: Any) -> Any:
    return value if _literal_default(value) else "<object>"


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


_PURE_FUNCTIONS = {getattr, operator.getitem, len, *[getattr(operator, n) for n in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "neg", "pos", "eq", "ne", "lt", "le", "gt", "ge", "not_",
    "and_", "or_", "xor", "is_", "is_not", "contains")]}
_PURE_METHODS = {"size", "dim", "numel", "stride", "is_contiguous", "__getitem__"}


def _eliminate_dead_queries(graph: fx.Graph) -> None:
    """Drop the shape queries that only served Python control flow (``bool(q_len > 1)``)."""
    for node in reversed(list(graph.nodes)):
        if node.users:
            continue
        if (node.op == "call_function" and node.target in _PURE_FUNCTIONS) or \
                (node.op == "call_method" and node.target in _PURE_METHODS) or node.op == "get_attr":
            graph.erase_node(node)


# ---------------------------------------------------------------------------------------------
# building the traced module
# ---------------------------------------------------------------------------------------------

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


def build_traced_module(original: nn.Module, graph: fx.Graph, tracer: SchedlangTracer) -> TracedModule:
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
                if key == "_schedlang_shards" and isinstance(value, dict):
                    owned = set(target._parameters) | set(target._buffers)
                    value = {k: v for k, v in value.items() if k in owned}
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


# ---------------------------------------------------------------------------------------------
# public entry points
# ---------------------------------------------------------------------------------------------


def _new_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def trace_module(module: nn.Module, *, path: str = "", recursive: bool = True, flatten: bool = False,
                 leaf_modules: Optional[Iterable[Any]] = None, concrete_args: Optional[Dict[str, Any]] = None,
                 call: Optional[Tuple[Tuple, Dict[str, Any]]] = None, fake_mode=None) -> TracedModule:
    """Trace ``module`` into a :class:`TracedModule`; raise :class:`TraceError` on failure.

    ``path`` is used in messages and to resolve ``leaf_modules`` names (relative to
    ``module``). ``call`` is a recorded ``(args, kwargs)`` call (e.g. from
    :func:`capture_call`, values may be fake tensors); without it the signature policy and
    ``concrete_args`` decide the inputs. The module itself is not changed.

    Example::

        gm = trace_module(mlp, flatten=True)
        assert torch.equal(gm(x), mlp(x))
    """
    leaf_types, leaf_names = [], set()
    for item in leaf_modules or ():
        if isinstance(item, type):
            leaf_types.append(item)
        else:
            leaf_names.add(".".join(p for p in (path, item) if p))
    fake_mode = fake_mode or _new_fake_mode()
    options = _Options(recursive=recursive, flatten=flatten, leaf_types=tuple(leaf_types), leaf_names=leaf_names,
                       fake_mode=fake_mode)
    where = path or "<root>"
    if "forward" in module.__dict__ and not getattr(module, "_schedlang_checkpointed", False):
        raise TraceError(f"{where}: {type(module).__name__} has a forward set on the instance, which FX cannot "
                         "trace; trace its parent with this module as a leaf instead")
    tracer = SchedlangTracer(options, path=path)

    def make_example(t):
        if _is_fake(t):
            return t
        if t.device.type == "meta":  # an example from a plan: only its shape and dtype count
            device = _module_device(module)
            with fake_mode:
                return torch.empty(t.shape, dtype=t.dtype, device="cpu" if device.type == "meta" else device)
        return fake_mode.from_tensor(t)

    try:
        with _tracing_patches(module):
            if call is not None:
                spec = CallSpec.from_call(module, call[0], call[1], lambda v: tracer._map_examples_safe(v))
            else:
                spec = CallSpec.from_signature(module, concrete_args, make_example)
            gm, _ = tracer.trace_to_module(module, spec)
    except TraceError:
        raise
    except SchedlangError:
        raise
    except Exception as e:
        raise TraceError(f"{where}: cannot trace {type(module).__name__}: {_describe(e)}") from e
    return gm


def _map_examples_safe(self, value):
    def conv(v):
        if isinstance(v, torch.Tensor):
            return self._fake(v)
        if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
            return type(v)(conv(x) for x in v)
        if isinstance(v, dict) and type(v) is dict:
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(value)


SchedlangTracer._map_examples_safe = _map_examples_safe


class _Captured(Exception):
    pass


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` looks like a transformers ``PreTrainedModel`` taking ``input_ids``."""
    config = getattr(module, "config", None)
    return (getattr(module, "main_input_name", None) == "input_ids" and config is not None
            and getattr(config, "vocab_size", None) is not None and not isinstance(module, fx.GraphModule))


def capture_call(container: nn.Module, target: nn.Module, fake_mode=None) -> Tuple[Tuple, Dict[str, Any]]:
    """Run the HF model ``container`` once on a synthesized fake ``input_ids`` and return the
    ``(args, kwargs)`` its submodule ``target`` is first called with (tensors are fake).

    Every forward hook is switched off during the run (no collectives are issued). Raises
    :class:`TraceError` if ``target`` is not reached.
    """
    fake_mode = fake_mode or _new_fake_mode()
    captured: Dict[str, Any] = {}

    def grab(mod, args, kwargs):
        captured["call"] = (args, kwargs)
        raise _Captured()

    saved = []
    for m in container.modules():
        saved.append((m, m._forward_hooks, m._forward_pre_hooks))
        m._forward_hooks, m._forward_pre_hooks = collections.OrderedDict(), collections.OrderedDict()
    handle = target.register_forward_pre_hook(grab, with_kwargs=True, prepend=True)
    params = {p.name for p in forward_parameters(container)}
    has_varkw = any(p.kind is _P.VAR_KEYWORD for p in forward_parameters(container))
    kwargs: Dict[str, Any] = {}
    if "use_cache" in params or has_varkw:
        kwargs["use_cache"] = False
    try:
        device = _module_device(container)
        if device.type == "meta":
            device = torch.device("cpu")
        with _shape_only_syncs(), fake_mode, torch.no_grad():
            ids = torch.zeros(EXAMPLE_BATCH, EXAMPLE_SEQUENCE, dtype=torch.long, device=device)
            container(input_ids=ids, **kwargs)
    except _Captured:
        pass
    finally:
        handle.remove()
        for m, fwd, pre in saved:
            m._forward_hooks, m._forward_pre_hooks = fwd, pre
    if "call" not in captured:
        raise TraceError(f"{type(target).__name__} was not called when running {type(container).__name__}")
    return captured["call"]

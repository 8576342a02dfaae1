"""The operators a pattern is matched by: every call node in one canonical form, so that functional,
method and module spellings of one operator compare equal (``F.gelu`` / ``nn.GELU``, ``x.add(y)`` /
``torch.add``, ``F.linear`` / ``nn.Linear``), with named arguments; and the ``call_module`` marker a
pattern function uses for "a call of any module whose name matches". :mod:`schedlang.graph.pattern`
matches graphs on these forms.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..errors import PatternError
from .tracer.training_mode import ModeDependentCall

__all__ = ["call_module", "check_regex", "canonicalize", "pattern_canonicalize", "single_op_of", "ParamRef", "Canon",
           "raw_args", "defaults_of", "same_value", "CALLS"]

CALLS = ("call_function", "call_method", "call_module")


# ---------------------------------------------------------------------------------------------
# call_module marker
# ---------------------------------------------------------------------------------------------


def check_regex(regex, who: str, where: str = "") -> None:
    """A module-name regex of a pattern: a string that compiles (PatternError naming ``who`` otherwise)."""
    if not isinstance(regex, str):
        raise PatternError(f"find: {who} expects a regex string{' ' + where if where else ''}, got {regex!r}")
    try:
        re.compile(regex)
    except re.error as e:
        raise PatternError(f"{who}: invalid regex {regex!r}: {e}; pass a valid Python regular expression") from e


def call_module(regex: str, *args: Any, **kwargs: Any) -> Any:
    """In a pattern function: a call of any module whose name matches ``regex``.

    Example::

        def qkv(x):
            return schedlang.call_module(r"[qkv]_proj", x).view(2, 8, 4, 16)
    """
    tracer = None
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, fx.Proxy):
            tracer = leaf.tracer
            break
    if tracer is None:
        raise PatternError("find: schedlang.call_module(regex, *args) describes a module call inside a pattern function "
                           "passed to find(); it cannot be called on real tensors")
    check_regex(regex, "call_module", "as its first argument")
    return tracer.create_proxy("call_function", call_module, (regex,) + tuple(args), kwargs)


# ---------------------------------------------------------------------------------------------
# canonical operators
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParamRef:
    """A module's parameter seen as an argument (``nn.Linear`` -> ``weight``, ``bias``)."""

    module: str
    name: str


@dataclasses.dataclass
class _OpSpec:
    key: str
    functions: Tuple[Callable, ...] = ()
    methods: Tuple[str, ...] = ()
    modules: Dict[type, Callable[[nn.Module, str], Dict[str, Any]]] = dataclasses.field(default_factory=dict)
    positional: Tuple[str, ...] = ("input",)
    defaults: Dict[str, Any] = dataclasses.field(default_factory=dict)
    commutative: bool = False


def _params(*names):
    def get(mod, path):
        return {n: (ParamRef(path, n) if getattr(mod, n, None) is not None else None) for n in names}

    return get


def _attrs(**mapping):
    def get(mod, path):
        return {k: getattr(mod, attr) for k, attr in mapping.items()}

    return get


def _both(*getters):
    def get(mod, path):
        out = {}
        for g in getters:
            out.update(g(mod, path))
        return out

    return get


def _fns(*candidates) -> Tuple[Callable, ...]:
    return tuple(c for c in candidates if c is not None)


_BINARY = ("input", "other")
_SPECS: List[_OpSpec] = [
    _OpSpec("add", _fns(operator.add, operator.iadd, torch.add, torch.Tensor.add), ("add",), positional=_BINARY,
            defaults={"alpha": 1}, commutative=True),
    _OpSpec("sub", _fns(operator.sub, operator.isub, torch.sub, torch.Tensor.sub), ("sub",), positional=_BINARY,
            defaults={"alpha": 1}),
    _OpSpec("mul", _fns(operator.mul, operator.imul, torch.mul, torch.Tensor.mul), ("mul",), positional=_BINARY,
            commutative=True),
    _OpSpec("div", _fns(operator.truediv, operator.itruediv, torch.div, torch.true_divide, torch.Tensor.div),
            ("div", "true_divide"), positional=_BINARY, defaults={"rounding_mode": None}),
    _OpSpec("matmul", _fns(operator.matmul, torch.matmul, torch.Tensor.matmul), ("matmul",), positional=_BINARY),
    _OpSpec("pow", _fns(operator.pow, torch.pow, torch.Tensor.pow), ("pow",), positional=("input", "exponent")),
    _OpSpec("neg", _fns(operator.neg, torch.neg), ("neg",)),
    _OpSpec("gelu", _fns(F.gelu), ("gelu",), {nn.GELU: _attrs(approximate="approximate")},
            positional=("input", "approximate"), defaults={"approximate": "none"}),
    _OpSpec("relu", _fns(F.relu, torch.relu), ("relu",), {nn.ReLU: _attrs()}),
    _OpSpec("silu", _fns(F.silu), (), {nn.SiLU: _attrs()}),
    _OpSpec("sigmoid", _fns(torch.sigmoid, F.sigmoid), ("sigmoid",), {nn.Sigmoid: _attrs()}),
    _OpSpec("tanh", _fns(torch.tanh, F.tanh), ("tanh",), {nn.Tanh: _attrs()}),
    _OpSpec("softmax", _fns(F.softmax, torch.softmax), ("softmax",), {nn.Softmax: _attrs(dim="dim")},
            positional=("input", "dim"), defaults={"dim": None, "dtype": None}),
    _OpSpec("dropout", _fns(F.dropout), (), {nn.Dropout: _attrs(p="p")},
            positional=("input", "p", "training"), defaults={"p": 0.5, "training": True}),
    _OpSpec("linear", _fns(F.linear), (), {nn.Linear: _params("weight", "bias")},
            positional=("input", "weight", "bias"), defaults={"bias": None}),
    _OpSpec("layer_norm", _fns(F.layer_norm), (),
            {nn.LayerNorm: _both(_params("weight", "bias"), _attrs(normalized_shape="normalized_shape", eps="eps"))},
            positional=("input", "normalized_shape", "weight", "bias", "eps"),
            defaults={"weight": None, "bias": None, "eps": 1e-5}),
    _OpSpec("embedding", _fns(F.embedding), (), {nn.Embedding: _both(_params("weight"),
                                                                     _attrs(padding_idx="padding_idx"))},
            positional=("input", "weight", "padding_idx"), defaults={"padding_idx": None}),
    _OpSpec("rsqrt", _fns(torch.rsqrt), ("rsqrt",)),
    _OpSpec("sqrt", _fns(torch.sqrt), ("sqrt",)),
    _OpSpec("exp", _fns(torch.exp), ("exp",)),
    _OpSpec("log", _fns(torch.log), ("log",)),
    _OpSpec("abs", _fns(torch.abs, operator.abs), ("abs",)),
    _OpSpec("mean", _fns(torch.mean), ("mean",), positional=("input", "dim", "keepdim"), defaults={"keepdim": False}),
    _OpSpec("sum", _fns(torch.sum), ("sum",), positional=("input", "dim", "keepdim"), defaults={"keepdim": False}),
    _OpSpec("transpose", _fns(torch.transpose), ("transpose",), positional=("input", "dim0", "dim1")),
]
if hasattr(F, "rms_norm") and hasattr(nn, "RMSNorm"):
    _SPECS.append(_OpSpec("rms_norm", _fns(F.rms_norm), (),
                          {nn.RMSNorm: _both(_params("weight"),
                                             _attrs(normalized_shape="normalized_shape", eps="eps"))},
                          positional=("input", "normalized_shape", "weight", "eps"),
                          defaults={"weight": None, "eps": None}))

_BY_FUNCTION = {id(f): s for s in _SPECS for f in s.functions}
_BY_METHOD = {m: s for s in _SPECS for m in s.methods}
_BY_MODULE = [(t, s) for s in _SPECS for t in s.modules]
_IGNORED_ARGS = {"inplace", "out"}


@dataclasses.dataclass
class Canon:
    key: Any
    args: Dict[str, Any]
    commutative: bool = False
    regex: Optional[str] = None
    exact: bool = False  # generic ops: positional arguments must line up exactly


def _named(spec: _OpSpec, args: Sequence[Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    named: Dict[str, Any] = {}
    for i, a in enumerate(args):
        named[spec.positional[i] if i < len(spec.positional) else f"#{i}"] = a
    for k, v in kwargs.items():
        if k not in _IGNORED_ARGS and not k.startswith("_"):
            named[k] = v
    return named


def _python_defaults(fn: Callable) -> Dict[str, Any]:
    """Defaults of a Python-level function; FX records them as if they had been passed."""
    if not hasattr(fn, "__code__"):
        return {}  # builtins: FX records only what the caller passed
    try:
        return {p.name: p.default for p in inspect.signature(fn).parameters.values()
                if p.default is not inspect.Parameter.empty}
    except (TypeError, ValueError):
        return {}


def _drop_recorded_defaults(canon: "Canon", fn: Callable, spec: Optional[_OpSpec]) -> "Canon":
    defaults = _python_defaults(fn)
    if not defaults:
        return canon
    names = dict(zip(spec.positional, inspect.signature(fn).parameters)) if spec is not None else {}
    kept = {}
    for key, value in canon.args.items():
        param = names.get(key, key)
        if param in defaults and same_value(defaults[param], value) and not isinstance(value, fx.Node):
            continue
        kept[key] = value
    return dataclasses.replace(canon, args=kept)


def pattern_canonicalize(node: fx.Node, owner: nn.Module) -> "Canon":
    """Like :func:`canonicalize`, but arguments a pattern left at their default are not compared."""
    canon = canonicalize(node, owner)
    if node.op == "call_function" and node.target is not call_module:
        canon = _drop_recorded_defaults(canon, node.target, _BY_FUNCTION.get(id(node.target)))
    return canon


def canonicalize(node: fx.Node, owner: nn.Module, path: str = "") -> Canon:
    """The canonical operator and named arguments of a call node of ``owner``'s graph."""
    if node.op == "call_function" and node.target is call_module:
        regex, *rest = node.args
        args = {f"#{i}": a for i, a in enumerate(rest)}
        args.update(node.kwargs)
        return Canon(("call_module",), args, regex=regex, exact=True)
    if node.op == "call_function":
        spec = _BY_FUNCTION.get(id(node.target))
        if spec is not None:
            return Canon(spec.key, _named(spec, node.args, node.kwargs), spec.commutative)
        return Canon(("function", node.target), _generic(node.args, node.kwargs), exact=True)
    if node.op == "call_method":
        spec = _BY_METHOD.get(node.target)
        if spec is not None:
            return Canon(spec.key, _named(spec, node.args, node.kwargs), spec.commutative)
        return Canon(("method", node.target), _generic(node.args, node.kwargs), exact=True)
    if node.op == "call_module":
        module = owner.get_submodule(node.target)
        if isinstance(module, ModeDependentCall):  # the call it makes in its current mode
            args, kwargs = module.call_for(node.args)
            spec = _BY_FUNCTION.get(id(module.target))
            if spec is not None:
                return Canon(spec.key, _named(spec, args, kwargs), spec.commutative)
            return Canon(("function", module.target), _generic(args, kwargs), exact=True)
        for module_type, spec in _BY_MODULE:
            if type(module) is module_type:
                named = _named(_OpSpec(spec.key, positional=("input",)), node.args, node.kwargs)
                named.update(spec.modules[module_type](module, node.target))
                return Canon(spec.key, named, spec.commutative)
        inner = single_op_of(module)
        if inner is not None:  # e.g. transformers' GELUActivation traced into `gelu(input)`
            return _substitute(canonicalize(inner, module), _placeholder_values(module, node))
        return Canon(("module", type(module)), _generic(node.args, node.kwargs), exact=True)
    raise ValueError(f"not a call node: {node.format_node()}")


def single_op_of(module: nn.Module) -> Optional[fx.Node]:
    """The one call node of a parameter-free traced module that just applies one op to its
    inputs (a wrapper such as an activation module), else None."""
    if not isinstance(module, fx.GraphModule) or any(True for _ in module.parameters()) or \
            any(True for _ in module.buffers()):
        return None
    calls = [n for n in module.graph.nodes if n.op in CALLS]
    others = [n for n in module.graph.nodes if n.op not in CALLS + ("placeholder", "output")]
    if len(calls) != 1 or others:
        return None
    output = next(n for n in module.graph.nodes if n.op == "output")
    if output.args[0] is not calls[0] or calls[0].op == "call_module" and single_op_of(
            module.get_submodule(calls[0].target)) is None and not _is_known_module(
            module.get_submodule(calls[0].target)):
        return None
    return calls[0]


def _is_known_module(module: nn.Module) -> bool:
    return any(type(module) is t for t, _ in _BY_MODULE)


def _placeholder_values(module: fx.GraphModule, call: fx.Node) -> Dict[fx.Node, Any]:
    """What each placeholder of ``module``'s graph is bound to by the call node ``call``."""
    values: Dict[fx.Node, Any] = {}
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    for i, ph in enumerate(placeholders):
        if i < len(call.args):
            values[ph] = call.args[i]
        elif ph.target in call.kwargs:
            values[ph] = call.kwargs[ph.target]
        elif ph.args:
            values[ph] = ph.args[0]
    return values


def _substitute(canon: Canon, values: Dict[fx.Node, Any]) -> Canon:
    def sub(v):
        if isinstance(v, fx.Node):
            return values.get(v, v)
        if isinstance(v, (tuple, list)):
            return type(v)(sub(x) for x in v)
        if isinstance(v, dict):
            return {k: sub(x) for k, x in v.items()}
        return v

    return dataclasses.replace(canon, args={k: sub(v) for k, v in canon.args.items()})


def _generic(args, kwargs) -> Dict[str, Any]:
    named = {f"#{i}": a for i, a in enumerate(args)}
    named.update({k: v for k, v in kwargs.items() if not k.startswith("_")})
    return named


def raw_args(node: fx.Node) -> Dict[str, Any]:
    return _generic(node.args, node.kwargs)


def defaults_of(key) -> Dict[str, Any]:
    for spec in _SPECS:
        if spec.key == key:
            return spec.defaults
    return {}


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, fx.Node) or isinstance(b, fx.Node) or isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, (tuple, list)) and len(a) == 1:
        return same_value(a[0], b)
    if isinstance(b, (tuple, list)) and len(b) == 1:
        return same_value(a, b[0])
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    try:
        same = a == b
    except Exception:
        return False
    return same is True

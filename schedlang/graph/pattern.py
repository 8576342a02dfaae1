"""Finding parts of a traced module: regexes over module names, pattern functions by dataflow.

``find_nodes(module, regex)`` returns the ``call_module`` nodes whose qualified module name
(relative to ``module``) matches ``regex`` (``re.search``), as ``(path, node)`` pairs where
``path`` names the traced module whose graph holds the node.

``find_subgraphs(module, pattern)`` traces ``pattern`` (a function, an ``nn.Module`` or an
``nn.Module`` subclass) and returns every non-overlapping place where the traced graphs
compute the same thing, as a list of subgraphs (lists of ``(path, node)`` in graph order).
Matching follows dataflow from the pattern's outputs back to its inputs, so

* node order and unrelated nodes in between do not matter;
* ``x + y`` matches ``y + x`` (``add`` and ``mul`` are commutative);
* functional and module forms are the same operator: ``F.gelu`` / ``nn.GELU``,
  ``F.relu`` / ``torch.relu`` / ``x.relu()`` / ``nn.ReLU``, ``F.linear`` / ``nn.Linear``,
  ``operator.add`` / ``torch.add`` / ``x.add(y)``, ``F.layer_norm`` / ``nn.LayerNorm`` ...;
* a pattern input matches any value (a node, a parameter, a constant). An input used twice
  preferably matches the same value twice (``x * torch.sigmoid(x)``), but, as in Slapo, each
  use may also match a different value (``F.relu(x) + x`` finds ``relu(conv(x)) + x``);
  ``strict=True`` requires the same value;
* a constant the pattern passes must be equal in the graph (``F.gelu(x, approximate="tanh")``);
  an argument the pattern leaves out, or leaves at the default of a Python-level function
  such as ``F.dropout``, is not compared (``F.dropout(x)`` matches ``nn.Dropout(0.1)``);
* ``call_module(regex, *args)`` matches a call of any module whose name matches ``regex``;
* matches never share nodes. A match whose intermediate values are used only inside it is
  preferred; one whose intermediates are also used elsewhere is still reported (they become
  extra outputs of the subgraph), unless ``strict=True``.

Whatever matched, ``replace`` and ``fuse`` work on the matched nodes themselves: a
replacement receives the subgraph's actual inputs and must produce all of its outputs, so a
loose match can be replaced only by something that computes what those nodes compute.

Example::

    sch.trace(flatten=True)
    subgraphs = sch.find(lambda x, b: F.gelu(x + b))   # [[('', add), ('', activation)]]
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import re
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..errors import PatternError
from ..module_record import module_record
from .tracer.training_mode import ModeDependentCall

__all__ = ["call_module", "find_nodes", "find_subgraphs", "trace_pattern", "graph_modules", "ParamRef"]

_CALLS = ("call_function", "call_method", "call_module")


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
class _Canon:
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


def _drop_recorded_defaults(canon: "_Canon", fn: Callable, spec: Optional[_OpSpec]) -> "_Canon":
    defaults = _python_defaults(fn)
    if not defaults:
        return canon
    names = dict(zip(spec.positional, inspect.signature(fn).parameters)) if spec is not None else {}
    kept = {}
    for key, value in canon.args.items():
        param = names.get(key, key)
        if param in defaults and _same_value(defaults[param], value) and not isinstance(value, fx.Node):
            continue
        kept[key] = value
    return dataclasses.replace(canon, args=kept)


def pattern_canonicalize(node: fx.Node, owner: nn.Module) -> "_Canon":
    """Like :func:`canonicalize`, but arguments a pattern left at their default are not compared."""
    canon = canonicalize(node, owner)
    if node.op == "call_function" and node.target is not call_module:
        canon = _drop_recorded_defaults(canon, node.target, _BY_FUNCTION.get(id(node.target)))
    return canon


def canonicalize(node: fx.Node, owner: nn.Module, path: str = "") -> _Canon:
    """The canonical operator and named arguments of a call node of ``owner``'s graph."""
    if node.op == "call_function" and node.target is call_module:
        regex, *rest = node.args
        args = {f"#{i}": a for i, a in enumerate(rest)}
        args.update(node.kwargs)
        return _Canon(("call_module",), args, regex=regex, exact=True)
    if node.op == "call_function":
        spec = _BY_FUNCTION.get(id(node.target))
        if spec is not None:
            return _Canon(spec.key, _named(spec, node.args, node.kwargs), spec.commutative)
        return _Canon(("function", node.target), _generic(node.args, node.kwargs), exact=True)
    if node.op == "call_method":
        spec = _BY_METHOD.get(node.target)
        if spec is not None:
            return _Canon(spec.key, _named(spec, node.args, node.kwargs), spec.commutative)
        return _Canon(("method", node.target), _generic(node.args, node.kwargs), exact=True)
    if node.op == "call_module":
        module = owner.get_submodule(node.target)
        if isinstance(module, ModeDependentCall):  # the call it makes in its current mode
            args, kwargs = module.call_for(node.args)
            spec = _BY_FUNCTION.get(id(module.target))
            if spec is not None:
                return _Canon(spec.key, _named(spec, args, kwargs), spec.commutative)
            return _Canon(("function", module.target), _generic(args, kwargs), exact=True)
        for module_type, spec in _BY_MODULE:
            if type(module) is module_type:
                named = _named(_OpSpec(spec.key, positional=("input",)), node.args, node.kwargs)
                named.update(spec.modules[module_type](module, node.target))
                return _Canon(spec.key, named, spec.commutative)
        inner = single_op_of(module)
        if inner is not None:  # e.g. transformers' GELUActivation traced into `gelu(input)`
            return _substitute(canonicalize(inner, module), _placeholder_values(module, node))
        return _Canon(("module", type(module)), _generic(node.args, node.kwargs), exact=True)
    raise ValueError(f"not a call node: {node.format_node()}")


def single_op_of(module: nn.Module) -> Optional[fx.Node]:
    """The one call node of a parameter-free traced module that just applies one op to its
    inputs (a wrapper such as an activation module), else None."""
    if not isinstance(module, fx.GraphModule) or any(True for _ in module.parameters()) or \
            any(True for _ in module.buffers()):
        return None
    calls = [n for n in module.graph.nodes if n.op in _CALLS]
    others = [n for n in module.graph.nodes if n.op not in _CALLS + ("placeholder", "output")]
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


def _substitute(canon: _Canon, values: Dict[fx.Node, Any]) -> _Canon:
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


def _raw_args(node: fx.Node) -> Dict[str, Any]:
    return _generic(node.args, node.kwargs)


# ---------------------------------------------------------------------------------------------
# pattern tracing
# ---------------------------------------------------------------------------------------------


def _pattern_name(pattern: Any) -> str:
    return getattr(pattern, "__name__", None) or type(pattern).__name__


def trace_pattern(pattern: Any) -> fx.GraphModule:
    """Trace a pattern function / module / module class into a GraphModule (PatternError on failure)."""
    if isinstance(pattern, type):
        if not issubclass(pattern, nn.Module):
            raise PatternError(f"a pattern class must subclass nn.Module, got {pattern.__qualname__}")
        try:
            pattern = pattern()
        except TypeError as e:
            raise PatternError(f"pattern module class {pattern.__qualname__} needs constructor arguments ({e}); "
                               "pass an instance instead") from e
    if not callable(pattern):
        raise PatternError(f"a pattern must be a regex string, a function or an nn.Module, got "
                           f"{type(pattern).__name__}")
    target = pattern.forward if isinstance(pattern, nn.Module) else pattern
    try:
        params = [p for p in inspect.signature(target).parameters.values()]
    except (TypeError, ValueError) as e:
        raise PatternError(f"cannot read the signature of pattern {_pattern_name(pattern)}: {e}") from e
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise PatternError(f"pattern {_pattern_name(pattern)} takes *args/**kwargs; give every input a name")
    tracer = fx.Tracer()
    try:
        graph = tracer.trace(pattern)
    except PatternError:
        raise
    except Exception as e:
        raise PatternError(f"cannot trace pattern {_pattern_name(pattern)}: {type(e).__name__}: {e}") from e
    gm = fx.GraphModule(tracer.root, graph)
    gm.graph.eliminate_dead_code()
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = _flatten_outputs(output.args[0])
    for o in outs:
        if not isinstance(o, fx.Node) or o.op not in _CALLS:
            raise PatternError(f"pattern {_pattern_name(pattern)} must return results of operations, but returns "
                               f"{o.name if isinstance(o, fx.Node) else repr(o)} directly")
    return gm


def _flatten_outputs(value: Any) -> List[Any]:
    if isinstance(value, (tuple, list)):
        out = []
        for v in value:
            out += _flatten_outputs(v)
        return out
    return [value]


# ---------------------------------------------------------------------------------------------
# matching
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _State:
    nodes: Tuple[Tuple[fx.Node, fx.Node], ...] = ()  # pattern op node -> target node
    binds: Tuple[Tuple[fx.Node, Any], ...] = ()  # pattern input -> target value
    used: FrozenSet[fx.Node] = frozenset()
    loose: bool = False  # some pattern input matched two different values


    def node(self, pn):
        for p, t in self.nodes:
            if p is pn:
                return t
        return None

    def bound(self, pn):
        for p, v in self.binds:
            if p is pn:
                return True, v
        return False, None

    def with_node(self, pn, tn) -> "_State":
        return dataclasses.replace(self, nodes=self.nodes + ((pn, tn),), used=self.used | {tn})

    def with_bind(self, pn, value) -> "_State":
        return dataclasses.replace(self, binds=self.binds + ((pn, value),))


_MISSING = object()
# how many candidate matches of one anchor are looked at for a preferred (exact) one
_MAX_STATES_PER_ANCHOR = 64


class _Matcher:
    def __init__(self, pattern: fx.GraphModule, owner: fx.GraphModule, path: str, strict: bool = False):
        self.pattern = pattern
        self.strict = strict
        self.owner = owner
        self.path = path
        self.pattern_canon = {n: pattern_canonicalize(n, pattern) for n in pattern.graph.nodes if n.op in _CALLS}
        self._target_canon: Dict[fx.Node, Optional[_Canon]] = {}
        output = next(n for n in pattern.graph.nodes if n.op == "output")
        self.outputs = []
        for o in _flatten_outputs(output.args[0]):
            if o not in self.outputs:
                self.outputs.append(o)
        self.order = {n: i for i, n in enumerate(owner.graph.nodes)}

    def target_canon(self, tn: fx.Node) -> Optional[_Canon]:
        if tn not in self._target_canon:
            try:
                self._target_canon[tn] = canonicalize(tn, self.owner, self.path)
            except Exception:
                self._target_canon[tn] = None
        return self._target_canon[tn]

    # a pattern op node against a target value
    def match_node(self, pn: fx.Node, tv: Any, state: _State) -> Iterator[_State]:
        done = state.node(pn)
        if done is not None:
            if done is tv:
                yield state
            return
        if not isinstance(tv, fx.Node) or tv.op not in _CALLS or tv in state.used:
            return
        pc, tc = self.pattern_canon[pn], self.target_canon(tv)
        if tc is None:
            return
        if pc.regex is not None:
            if tv.op != "call_module" or not re.search(pc.regex, tv.target):
                return
            target_args = _raw_args(tv)
        elif pc.key != tc.key:
            return
        else:
            target_args = tc.args
        if pc.exact and set(k for k in pc.args if k.startswith("#")) != set(k for k in target_args
                                                                             if k.startswith("#")):
            return
        state = state.with_node(pn, tv)
        orders = [pc.args]
        if pc.commutative and "input" in pc.args and "other" in pc.args:
            swapped = dict(pc.args)
            swapped["input"], swapped["other"] = pc.args["other"], pc.args["input"]
            orders.append(swapped)
        defaults = _defaults_of(pc.key)
        for args in orders:
            yield from self._match_args(list(args.items()), target_args, defaults, state)

    def _match_args(self, items, target_args, defaults, state) -> Iterator[_State]:
        if not items:
            yield state
            return
        (name, pv), rest = items[0], items[1:]
        tv = target_args.get(name, defaults.get(name, _MISSING))
        if tv is _MISSING:
            return
        for st in self.match_value(pv, tv, state):
            yield from self._match_args(rest, target_args, defaults, st)

    def match_value(self, pv: Any, tv: Any, state: _State) -> Iterator[_State]:
        if isinstance(pv, fx.Node):
            if pv.op in ("placeholder", "get_attr"):
                seen, value = state.bound(pv)
                if not seen:
                    yield state.with_bind(pv, tv)
                elif _same_value(value, tv):
                    yield state
                elif not self.strict:
                    yield dataclasses.replace(state, loose=True)
                return
            yield from self.match_node(pv, tv, state)
            return
        if isinstance(pv, ParamRef):
            yield state  # a pattern module's own parameter: any value
            return
        if isinstance(tv, fx.Node):
            return  # the pattern passes a constant where the graph computes a value
        if isinstance(pv, (tuple, list)) and not isinstance(tv, (tuple, list)) and len(pv) == 1:
            yield from self.match_value(pv[0], tv, state)
            return
        if isinstance(tv, (tuple, list)) and not isinstance(pv, (tuple, list)) and len(tv) == 1:
            yield from self.match_value(pv, tv[0], state)
            return
        if isinstance(pv, (tuple, list)):
            if not isinstance(tv, (tuple, list)) or len(tv) != len(pv):
                return
            yield from self._match_sequence(list(zip(pv, tv)), state)
            return
        if isinstance(pv, slice):
            if isinstance(tv, slice):
                yield from self._match_sequence([(pv.start, tv.start), (pv.stop, tv.stop), (pv.step, tv.step)], state)
            return
        if isinstance(pv, dict):
            if isinstance(tv, dict) and set(pv) == set(tv):
                yield from self._match_sequence([(pv[k], tv[k]) for k in pv], state)
            return
        if _same_value(pv, tv):
            yield state

    def _match_sequence(self, pairs, state) -> Iterator[_State]:
        if not pairs:
            yield state
            return
        (pv, tv), rest = pairs[0], pairs[1:]
        for st in self.match_value(pv, tv, state):
            yield from self._match_sequence(rest, st)

    # whole matches
    def candidates(self, pn: fx.Node) -> List[fx.Node]:
        pc = self.pattern_canon[pn]
        out = []
        for tn in self.owner.graph.nodes:
            if tn.op not in _CALLS:
                continue
            tc = self.target_canon(tn)
            if tc is None:
                continue
            if pc.regex is not None:
                if tn.op == "call_module" and re.search(pc.regex, tn.target):
                    out.append(tn)
            elif tc.key == pc.key:
                out.append(tn)
        return out

    def matches(self) -> List[List[fx.Node]]:
        taken: set = set()
        found: List[List[fx.Node]] = []
        candidates = {o: self.candidates(o) for o in self.outputs}
        for anchor in candidates[self.outputs[0]]:
            if anchor in taken:
                continue
            # an exact match (inputs bound consistently, intermediates private) wins; otherwise the
            # first loose one, which is what Slapo's matcher reports
            chosen = None
            for k, state in enumerate(self._match_outputs(0, anchor, _State(), candidates)):
                if k >= _MAX_STATES_PER_ANCHOR:
                    break
                nodes = [t for _, t in state.nodes]
                if taken.intersection(nodes):
                    continue
                exact = not state.loose and self._contained(state)
                if exact:
                    chosen = nodes
                    break
                if chosen is None and not self.strict:
                    chosen = nodes
            if chosen is not None:
                taken.update(chosen)
                found.append(sorted(chosen, key=self.order.__getitem__))
        return found

    def _match_outputs(self, i, anchor, state, candidates) -> Iterator[_State]:
        for st in self.match_node(self.outputs[i], anchor, state):
            if i + 1 == len(self.outputs):
                yield st
                continue
            nxt = self.outputs[i + 1]
            bound = st.node(nxt)
            options = [bound] if bound is not None else candidates[nxt]
            for cand in options:
                yield from self._match_outputs(i + 1, cand, st, candidates)

    def _contained(self, state: _State) -> bool:
        """Only the pattern's outputs may be used outside the match."""
        matched = {t for _, t in state.nodes}
        outputs = {state.node(o) for o in self.outputs}
        for _, tn in state.nodes:
            if tn in outputs:
                continue
            if any(u not in matched for u in tn.users):
                return False
        return True


def _defaults_of(key) -> Dict[str, Any]:
    for spec in _SPECS:
        if spec.key == key:
            return spec.defaults
    return {}


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, fx.Node) or isinstance(b, fx.Node) or isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, (tuple, list)) and len(a) == 1:
        return _same_value(a[0], b)
    if isinstance(b, (tuple, list)) and len(b) == 1:
        return _same_value(a, b[0])
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    try:
        same = a == b
    except Exception:
        return False
    return same is True


# ---------------------------------------------------------------------------------------------
# public search functions
# ---------------------------------------------------------------------------------------------


def graph_modules(module: nn.Module, prefix: str = "") -> List[Tuple[str, fx.GraphModule]]:
    """Every traced module under ``module`` (itself first), as ``(path, module)``, pre-order.

    Fused kernels and checkpointed regions are not searched.
    """
    out: List[Tuple[str, fx.GraphModule]] = []

    def visit(m: nn.Module, path: str) -> None:
        record = module_record(m)
        if record.fused or record.checkpointed:
            return
        if isinstance(m, fx.GraphModule):
            out.append((path, m))
        for name, child in m.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(module, prefix)
    return out


def find_nodes(module: nn.Module, regex: str) -> List[Tuple[str, fx.Node]]:
    """``call_module`` nodes whose module name (relative to ``module``) matches ``regex``."""
    try:
        compiled = re.compile(regex)
    except re.error as e:
        raise PatternError(f"find: invalid regex {regex!r}: {e}") from e
    found = []
    for path, gm in graph_modules(module):
        for node in gm.graph.nodes:
            if node.op != "call_module":
                continue
            full = f"{path}.{node.target}" if path else node.target
            if compiled.search(full):
                found.append((path, node))
    return found


def find_subgraphs(module: nn.Module, pattern: Any, strict: bool = False) -> List[List[Tuple[str, fx.Node]]]:
    """Non-overlapping matches of ``pattern`` in every traced graph under ``module``.

    ``strict=True`` reports only exact matches: every pattern input bound to one value, and
    no intermediate value used outside the match.
    """
    traced = pattern if isinstance(pattern, fx.GraphModule) else trace_pattern(pattern)
    found = []
    for path, gm in graph_modules(module):
        for nodes in _Matcher(traced, gm, path, strict).matches():
            found.append([(path, n) for n in nodes])
    return found

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
import re
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Tuple

import torch.fx as fx
from torch import nn

from ..errors import PatternError
from ..module_record import module_record
from .canonical import (CALLS, Canon, ParamRef, call_module, canonicalize, defaults_of,  # noqa: F401
                        pattern_canonicalize, raw_args, same_value)

__all__ = ["call_module", "find_nodes", "find_subgraphs", "trace_pattern", "graph_modules", "ParamRef"]

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
        if not isinstance(o, fx.Node) or o.op not in CALLS:
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
        self.pattern_canon = {n: pattern_canonicalize(n, pattern) for n in pattern.graph.nodes if n.op in CALLS}
        self._target_canon: Dict[fx.Node, Optional[Canon]] = {}
        output = next(n for n in pattern.graph.nodes if n.op == "output")
        self.outputs = []
        for o in _flatten_outputs(output.args[0]):
            if o not in self.outputs:
                self.outputs.append(o)
        self.order = {n: i for i, n in enumerate(owner.graph.nodes)}

    def target_canon(self, tn: fx.Node) -> Optional[Canon]:
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
        if not isinstance(tv, fx.Node) or tv.op not in CALLS or tv in state.used:
            return
        pc, tc = self.pattern_canon[pn], self.target_canon(tv)
        if tc is None:
            return
        if pc.regex is not None:
            if tv.op != "call_module" or not re.search(pc.regex, tv.target):
                return
            target_args = raw_args(tv)
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
        defaults = defaults_of(pc.key)
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
                elif same_value(value, tv):
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
        if same_value(pv, tv):
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
            if tn.op not in CALLS:
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

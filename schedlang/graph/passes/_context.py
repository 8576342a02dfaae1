"""What a rule works with: a private copy of the graph, new parameters, and the rule interface.

Rules never touch the GraphModule directly. They rewrite ``ctx.graph`` (a copy) and ask
for new parameters with :meth:`RewriteContext.new_parameter`; :meth:`RewriteContext.commit`
installs everything at the end. A failure before the commit leaves the module exactly as
it was, so a primitive built on these passes is never half-applied.
"""

from __future__ import annotations

import copy
import heapq
import operator
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch import fx, nn
from torch.utils.weak import WeakTensorKeyDictionary

from ._nodes import NUM_PIECES_META, is_call, split_spec

__all__ = ["RewriteContext", "Rule", "FusionRecord", "ParamSource", "FusedParameter", "FUSED_SOURCES"]

#: fused parameter -> where its parts come from (weakly keyed: forgotten with the parameter)
FUSED_SOURCES = WeakTensorKeyDictionary()


@dataclass(frozen=True)
class FusionRecord:
    """One rewrite: ``rule`` turned the nodes ``members`` into ``result`` (node names)."""

    rule: str
    members: Tuple[str, ...]
    result: str
    detail: str


@dataclass(frozen=True)
class ParamSource:
    """Where original parameter ``name`` lives inside a fused parameter.

    ``steps`` are applied in order to the fused tensor (or to its gradient):
    ``("narrow", dim, start, length)`` or ``("select", dim, index, 1)``.
    """

    name: str
    steps: Tuple[Tuple[str, int, int, int], ...]
    #: weak reference to the original parameter object (to find it again after a replay)
    source: Any = field(default=None, compare=False, repr=False)

    def take(self, fused: torch.Tensor) -> torch.Tensor:
        """The part of ``fused`` (the new parameter or its gradient) that holds this source."""
        out = fused
        for kind, dim, start, length in self.steps:
            out = out.select(dim, start) if kind == "select" else out.narrow(dim, start, length)
        return out


@dataclass
class FusedParameter:
    """A parameter made by a rule from others; ``sources`` say where each original lives in it."""

    name: str
    shape: Tuple[int, ...]
    sources: List[ParamSource]


class RewriteContext:
    """A rewrite session on a GraphModule: graph copy, new parameters, records."""

    def __init__(self, gm: fx.GraphModule, min_group_size: int = 2):
        self.gm = gm
        self.min_group_size = min_group_size
        self.graph = copy.deepcopy(gm.graph)
        self.records: List[FusionRecord] = []
        self.created: Set[fx.Node] = set()
        self.fused_parameters: Dict[str, FusedParameter] = {}
        self._pending: Dict[str, nn.Parameter] = {}
        self._pending_buffers: Dict[str, torch.Tensor] = {}
        self._retired_targets: Set[str] = set()
        self._counters: Dict[str, int] = {}
        self._modules_cache: Dict[str, nn.Module] = {}
        names_by_id: Dict[int, int] = {}
        for _, p in gm.named_parameters(remove_duplicate=False):
            names_by_id[id(p)] = names_by_id.get(id(p), 0) + 1
        for _, b in gm.named_buffers(remove_duplicate=False):
            names_by_id[id(b)] = names_by_id.get(id(b), 0) + 1
        self._tied = {k for k, v in names_by_id.items() if v > 1}
        self.refresh_references()

    # ------------------------------------------------------------------ attribute access
    def refresh_references(self) -> None:
        """Re-count which call_module / get_attr nodes name each target (once per sweep)."""
        self._module_calls: Dict[str, int] = {}
        self._attr_nodes: Dict[str, List[fx.Node]] = {}
        self._referenced_modules: Set[str] = set()
        for node in self.graph.nodes:
            if node.op == "call_module":
                self._module_calls[node.target] = self._module_calls.get(node.target, 0) + 1
                self._referenced_modules.add(node.target)
            elif node.op == "get_attr":
                self._attr_nodes.setdefault(node.target, []).append(node)
        self._attr_prefixes = _prefixes(self._attr_nodes)

    def get_submodule(self, target: str) -> nn.Module:
        """``gm.get_submodule(target)``, cached (rules ask for the same modules many times)."""
        module = self._modules_cache.get(target)
        if module is None:
            module = self._modules_cache[target] = self.gm.get_submodule(target)
        return module

    def tensor(self, target: str) -> Any:
        """The value a get_attr target names (a pending new parameter or buffer, or an attribute of the module)."""
        if target in self._pending:
            return self._pending[target]
        if target in self._pending_buffers:
            return self._pending_buffers[target]
        obj: Any = self.gm
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj

    def _owner_called(self, target: str) -> bool:
        parts = target.split(".")
        for k in range(len(parts)):
            if ".".join(parts[:k]) in self._referenced_modules:
                return True
        return "" in self._referenced_modules

    def exclusive_attr(self, node: fx.Node) -> bool:
        """Whether get_attr ``node`` names a parameter used by this one node and one consumer only."""
        if node.op != "get_attr" or len(node.users) != 1:
            return False
        if len(self._attr_nodes.get(node.target, ())) != 1 or self._owner_called(node.target):
            return False
        value = self.tensor(node.target)
        return isinstance(value, nn.Parameter) and id(value) not in self._tied

    def exclusive_module(self, node: fx.Node) -> bool:
        """Whether call_module ``node`` is the only use of its module and of the module's tensors."""
        if node.op != "call_module" or self._module_calls.get(node.target) != 1:
            return False
        if node.target in self._attr_prefixes:
            return False
        module = self.get_submodule(node.target)
        return not any(id(p) in self._tied for p in module.parameters())

    def retire(self, target: str) -> None:
        """Mark a module or parameter target for deletion at commit, if nothing uses it then."""
        self._retired_targets.add(target)

    # ------------------------------------------------------------------ new nodes and parameters
    def unique(self, hint: str) -> str:
        k = self._counters.get(hint, 0)
        while True:
            name = f"{hint}_{k}"
            k += 1
            if name not in self._pending and name not in self._pending_buffers and not hasattr(self.gm, name):
                self._counters[hint] = k
                return name

    def new_parameter(self, hint: str, value: torch.Tensor, requires_grad: bool,
                      sources: Sequence[ParamSource]) -> fx.Node:
        """Register (at commit) a new parameter holding ``value``; return a get_attr node for it.

        The node is created at the graph's current insertion point.
        """
        name = self.unique(hint)
        self._pending[name] = nn.Parameter(value.detach().clone(), requires_grad=requires_grad)
        self.fused_parameters[name] = FusedParameter(name, tuple(value.shape), list(sources))
        return self.node("get_attr", name)

    def new_buffer(self, hint: str, value: torch.Tensor) -> fx.Node:
        """Register (at commit, like :meth:`new_parameter`) a non-persistent buffer holding ``value``: data a
        rewrite needs, not in the state dict, moved by ``.to()``. Returns a get_attr node for it.

        Deferred so that a rewrite that fails before commit leaves the module as it was.
        """
        name = self.unique(hint)
        self._pending_buffers[name] = value
        return self.node("get_attr", name)

    def node(self, op: str, target: Any, args: tuple = (), kwargs: Optional[dict] = None,
             num_pieces: Optional[int] = None) -> fx.Node:
        """Create a node at the current insertion point and remember that a rule made it."""
        n = self.graph.create_node(op, target, tuple(args), dict(kwargs or {}))
        if num_pieces is not None:
            n.meta[NUM_PIECES_META] = num_pieces
        self.created.add(n)
        return n

    def call(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self.node("call_function", target, args, kwargs)

    def method(self, name: str, *args: Any, **kwargs: Any) -> fx.Node:
        return self.node("call_method", name, args, kwargs)

    # ------------------------------------------------------------------ replacing and cleaning
    def replace(self, old: fx.Node, new: fx.Node) -> None:
        """Send every use of ``old`` to ``new`` and erase ``old`` (and inputs it leaves unused)."""
        old.replace_all_uses_with(new)
        self.erase(old)

    def erase(self, node: fx.Node) -> None:
        """Erase an unused node, then every pure input that it leaves unused."""
        stack = [node]
        while stack:
            n = stack.pop()
            if n.users or n.graph is not self.graph or n.op in ("placeholder", "output"):
                continue
            inputs = list(n.all_input_nodes)
            if n.op == "call_module":
                self.retire(n.target)
            if n.op == "get_attr":
                self.retire(n.target)
            self.graph.erase_node(n)
            self.created.discard(n)
            stack.extend(i for i in inputs if not i.users and self._pure(i))

    def _pure(self, node: fx.Node) -> bool:
        if node in self.created or node.op == "get_attr":
            return True
        if node.op == "call_function" and node.target is operator.getitem:
            return True
        return split_spec(node) is not None or is_call(
            node, (torch.stack, torch.cat, torch.narrow, torch.flatten, torch.unflatten, torch.movedim),
            ("view", "reshape", "unflatten", "flatten", "narrow", "movedim", "transpose", "contiguous"))

    def restore_topological_order(self) -> bool:
        """Reorder nodes so every node follows its inputs (stable); True if anything moved."""
        nodes = list(self.graph.nodes)
        position = {n: i for i, n in enumerate(nodes)}
        if all(position[i] < position[n] for n in nodes for i in n.all_input_nodes):
            return False
        waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
        heap = [(position[n], n.name, n) for n in nodes if waiting[n] == 0 and n.op != "output"]
        heapq.heapify(heap)
        order: List[fx.Node] = []
        output = next(n for n in reversed(nodes) if n.op == "output")
        while heap:
            _, _, n = heapq.heappop(heap)
            order.append(n)
            for user in n.users:
                waiting[user] -= 1
                if waiting[user] == 0 and user.op != "output":
                    heapq.heappush(heap, (position[user], user.name, user))
        if len(order) != len(nodes) - 1:
            raise RuntimeError("horizontal fusion produced a cycle in the graph")  # a bug, never user input
        # placeholders stay first, in their original order (they define the forward signature)
        order = [n for n in order if n.op == "placeholder"] + [n for n in order if n.op != "placeholder"]
        for n in order:
            output.prepend(n)
        return True

    def record(self, rule: str, members: Iterable[fx.Node], result: fx.Node, detail: str) -> None:
        self.records.append(FusionRecord(rule, tuple(m.name for m in members), result.name, detail))

    # ------------------------------------------------------------------ commit
    def commit(self) -> None:
        """Install the rewritten graph and the new parameters; delete what nothing uses any more."""
        gm = self.gm
        self.graph.lint()
        used = {n.target for n in self.graph.nodes if n.op in ("get_attr", "call_module")}
        for name, param in self._pending.items():
            if name in used:
                gm.register_parameter(name, param)
        for name, buffer in self._pending_buffers.items():
            if name in used:
                gm.register_buffer(name, buffer, persistent=False)
        gm.graph = self.graph
        gm.recompile()
        registry: Dict[str, FusedParameter] = dict(getattr(gm, "_schedlang_fused_params", {}))
        known = {**registry, **self.fused_parameters}
        for name, info in self.fused_parameters.items():
            if name in used:
                registry[name] = FusedParameter(name, info.shape, self._resolve(info.sources, known))
                FUSED_SOURCES[self._pending[name]] = registry[name]
        used_prefixes = _prefixes(used)
        for target in sorted(self._retired_targets, key=lambda t: -t.count(".")):
            if target in used_prefixes or target in self._pending:
                continue
            self._delete(target)
        gm._schedlang_fused_params = {k: v for k, v in registry.items() if hasattr(gm, k)}

    def _resolve(self, sources: Sequence[ParamSource], known: Dict[str, FusedParameter]) -> List[ParamSource]:
        """Express sources that are themselves fused parameters (now gone) by their own sources."""
        out: List[ParamSource] = []
        for s in sources:
            inner = known.get(s.name)
            if inner is None:
                out.append(s)
            else:
                out.extend(ParamSource(t.name, s.steps + t.steps, t.source)
                           for t in self._resolve(inner.sources, known))
        return out

    def _delete(self, target: str) -> None:
        owner_path, _, name = target.rpartition(".")
        try:
            owner = self.gm.get_submodule(owner_path) if owner_path else self.gm
        except AttributeError:
            return
        if name in owner._modules:
            del owner._modules[name]
        elif name in owner._parameters:
            del owner._parameters[name]
        elif name in owner._buffers:
            del owner._buffers[name]


def _prefixes(targets: Iterable[str]) -> Set[str]:
    """Every target and every dotted prefix of it ("a.b.c" -> "a", "a.b", "a.b.c")."""
    out: Set[str] = set()
    for t in targets:
        parts = t.split(".")
        for k in range(1, len(parts) + 1):
            out.add(".".join(parts[:k]))
    return out


class Rule:
    """One atomic horizontal rule (one small rewrite step), applied to every group it finds.

    A fusion rule implements :meth:`operands` and :meth:`group_of` (step one of grouping: a node's
    candidate key) and
    :meth:`rewrite` (one group into one op). ``needs_independence`` says whether members of
    a group may depend on each other (the driver then splits groups by reachability).
    A simplification rule (a :class:`SimplifyRule`) implements :meth:`matches` and
    :meth:`rewrite` on one match at a time.
    """

    name: str = ""
    description: str = ""
    needs_independence: bool = True

    def collect(self, ctx: RewriteContext) -> Dict[Hashable, List[fx.Node]]:
        """Candidates by key: every node for which :meth:`group_of` gives a key."""
        groups: Dict[Hashable, List[fx.Node]] = {}
        for node in ctx.graph.nodes:
            operands = self.operands(ctx, node)
            key = None if operands is None else self.group_of(ctx, *operands)
            if key is not None:
                groups.setdefault(key, []).append(node)
        return groups

    def operands(self, ctx: RewriteContext, node: fx.Node) -> Optional[tuple]:
        """The operands of ``node`` when it is an op this rule fuses, else None."""
        raise NotImplementedError

    def group_of(self, ctx: RewriteContext, *operands) -> Optional[Hashable]:
        """The key of the group a node with these operands may join, or None when it joins none."""
        raise NotImplementedError

    def matches(self, ctx: RewriteContext) -> List[Any]:
        raise NotImplementedError

    def rewrite(self, ctx: RewriteContext, key: Hashable, members: Any) -> bool:
        """Rewrite one group (or match); return False if it turned out not to apply."""
        raise NotImplementedError


class SimplifyRule(Rule):
    """A simplification rule that plans one node at a time: :meth:`plan` says whether (and how)
    a node is rewritten, :meth:`apply` rewrites it following that plan (an instance of a plan
    type of the rule, e.g. :class:`~schedlang.graph.passes._roundtrip.WholePieces`)."""

    def plan(self, node: fx.Node) -> Any:
        raise NotImplementedError

    def apply(self, ctx: RewriteContext, node: fx.Node, plan: Any) -> bool:
        raise NotImplementedError

    def matches(self, ctx: RewriteContext) -> List[fx.Node]:
        return [n for n in ctx.graph.nodes if self.plan(n) is not None]

    def rewrite(self, ctx: RewriteContext, key, node: fx.Node) -> bool:
        plan = self.plan(node)
        return False if plan is None else self.apply(ctx, node, plan)

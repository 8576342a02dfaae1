"""Graph rewrite: issue collectives early, wait for them late, so computation overlaps them.

Seed post 001, section 3.3: a blocking collective (``EmbeddingAllToAll`` there) becomes a
request and a wait, with the independent operations scheduled between them.

Three forms are handled:

* a :class:`~schedlang.distributed.sync_ops.SyncOp` leaf (``sch.sync(...)`` in forward
  mode, op ``all_reduce`` / ``all_gather`` / ``reduce_scatter``)::

      y = self.fc1._schedlang_sync_fwd_post_0(h)
      ->  pending = start_sync(self.fc1._schedlang_sync_fwd_post_0, h)   # where the call was
          ...independent nodes...
          y = wait_sync(pending)                                        # before the first use of y

* an in-place ``torch.distributed`` collective recorded in the graph (``all_reduce``,
  ``all_gather``, ``all_to_all_single`` ...; trace with
  ``torch.fx.Tracer(autowrap_modules=(math, torch.distributed))``): it gets
  ``async_op=True`` and a ``wait_work`` before the next node that touches one of its tensors;

* a functional collective's ``wait_tensor`` (``torch.distributed._functional_collectives``):
  moved down to just before the first use of its result.

Each start is also hoisted up to just after its inputs, past plain computation (never past
another collective or a module call, so every rank issues collectives in the same order).
The issue order of collectives is unchanged. Backward passes run their collectives as before.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set

import torch
import torch.distributed as dist
from torch import fx

__all__ = ["OverlapRecord", "OverlapReport", "overlap_communication", "DIST_COLLECTIVES"]


def _dist_functions() -> Dict[Any, str]:
    names = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
             "all_to_all", "all_to_all_single", "broadcast", "reduce"]
    found = {}
    if dist.is_available():
        from torch.distributed import distributed_c10d

        for n in names:
            f = getattr(distributed_c10d, n, None)
            if f is not None:
                found[f] = n
    return found


#: torch.distributed collectives the rewrite makes asynchronous, by function
DIST_COLLECTIVES = _dist_functions()

_VIEW_METHODS = {"view", "view_as", "reshape", "flatten", "unflatten", "narrow", "select", "transpose", "permute",
                 "t", "expand", "expand_as", "unsqueeze", "squeeze", "split", "chunk", "unbind", "movedim",
                 "as_strided", "detach", "contiguous", "__getitem__"}


@dataclass(frozen=True)
class OverlapRecord:
    """One collective made asynchronous: how many nodes now run between its start and its wait."""

    kind: str
    node: str
    start: str
    wait: str
    between: int


@dataclass
class OverlapReport:
    """What :func:`overlap_communication` changed."""

    path: str
    records: List[OverlapRecord] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.records)

    def __str__(self) -> str:
        lines = [f"overlap_communication at '{self.path or '<root>'}': {len(self.records)} collective(s) made "
                 f"asynchronous"]
        for r in self.records:
            lines.append(f"  {r.kind} '{r.node}': {r.start} ... {r.wait}, {r.between} node(s) in between")
        for s in self.skipped:
            lines.append(f"  left as is: {s}")
        return "\n".join(lines)


def _sync_op_class():
    try:
        from ...distributed.sync_ops import SyncOp
    except ImportError:  # pragma: no cover - the class is part of the package
        return None
    return SyncOp


def _is_wait_tensor(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    ops = getattr(torch.ops, "_c10d_functional", None)
    if ops is None or not hasattr(ops, "wait_tensor"):
        return False
    return node.target is ops.wait_tensor or node.target is ops.wait_tensor.default


def _is_inplace(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("__")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return (name.endswith("_") and not name.startswith("__")) or bool(node.kwargs.get("inplace")) or \
            "out" in node.kwargs
    return False


def _is_communication(node: fx.Node, sync_cls) -> bool:
    from ...distributed.overlap import start_sync, wait_sync, wait_work

    if node.op == "call_module":
        return True  # a module may communicate inside; keep collectives in program order around it
    if node.op == "call_function":
        if node.target in DIST_COLLECTIVES or node.target in (start_sync, wait_sync, wait_work):
            return True
        return "c10d" in str(getattr(node.target, "__module__", "")) or "_c10d_functional" in str(node.target)
    return False


def _aliases(nodes: Sequence[fx.Node]) -> Set[fx.Node]:
    """``nodes`` and every node that may view the same memory (through view-like ops, both ways)."""
    seen: Set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if (user.op == "call_method" and user.target in _VIEW_METHODS) or (
                    user.op == "call_function" and user.target is operator.getitem):
                stack.append(user)
        if (n.op == "call_method" and n.target in _VIEW_METHODS) or (
                n.op == "call_function" and n.target is operator.getitem):
            stack.extend(i for i in n.all_input_nodes)
    return seen


def _tensor_nodes(value: Any) -> List[fx.Node]:
    out: List[fx.Node] = []
    fx.node.map_arg(value, lambda n: out.append(n))
    return out


@dataclass(frozen=True)
class _OverlapPlan:
    """A collective of the graph to run asynchronously: its ``node`` and the ``op`` the report names."""

    node: fx.Node
    op: Any


class _SyncModulePlan(_OverlapPlan):
    """A sync module (a forward sync point): started where it stands, waited for at its first use."""


class _AsyncCollectivePlan(_OverlapPlan):
    """A ``torch.distributed`` collective whose result is unused: called with ``async_op=True``."""


class _WaitTensorPlan(_OverlapPlan):
    """A functional collective's ``wait_tensor``: moved down to the first use of its result."""


def overlap_communication(gm: fx.GraphModule, path: str = "", hoist: bool = True,
                          root: Optional[torch.nn.Module] = None) -> OverlapReport:
    """Rewrite ``gm`` so its forward collectives run asynchronously; returns the report.

    Sync points that run as forward hooks of a leaf module (``sch["fc2"].sync("fwd_post", ...)``
    on an ``nn.Linear``) are first made explicit nodes of the graph, and their hooks removed.
    ``root`` (default ``gm``) is the whole model, to check that such a module is used only here.
    Works on a copy of the graph, installed at the end.
    """
    import copy

    from ...distributed.overlap import start_sync, wait_sync, wait_work

    sync_cls = _sync_op_class()
    graph = copy.deepcopy(gm.graph)
    report = OverlapReport(path)
    unhook = _explicit_sync_nodes(gm, graph, root if root is not None else gm, report) if sync_cls else []
    plans: List[_OverlapPlan] = []
    for node in list(graph.nodes):
        if node.op == "call_module" and sync_cls is not None:
            module = gm.get_submodule(node.target)
            if not isinstance(module, sync_cls):
                continue
            if module.mode == "bwd_post" or callable(module.op) or len(node.args) != 1 or node.kwargs:
                report.skipped.append(f"'{node.name}' ({module.mode}, op "
                                      f"{getattr(module.op, '__name__', module.op)}): nothing to start early in "
                                      f"forward" if module.mode == "bwd_post" else
                                      f"'{node.name}': a user function, which cannot be made asynchronous")
                continue
            plans.append(_SyncModulePlan(node, module.op))
        elif node.op == "call_function" and node.target in DIST_COLLECTIVES:
            if node.users or node.kwargs.get("async_op"):
                report.skipped.append(f"'{node.name}': its return value is used")
                continue
            plans.append(_AsyncCollectivePlan(node, DIST_COLLECTIVES[node.target]))
        elif _is_wait_tensor(node):
            plans.append(_WaitTensorPlan(node, "wait_tensor"))
    for plan in plans:
        node, op = plan.node, plan.op
        if isinstance(plan, _SyncModulePlan):
            with graph.inserting_before(node):
                handle = graph.get_attr(node.target)
                start = graph.call_function(start_sync, (handle, node.args[0]))
            first_use = _first_use(node, [node])
            with graph.inserting_before(first_use):
                wait = graph.call_function(wait_sync, (start,))
            node.replace_all_uses_with(wait)
            graph.erase_node(node)
            if hoist:
                _hoist(start, sync_cls, handle)
            _pull_independent_work(gm, wait, {wait}, sync_cls)
            report.records.append(OverlapRecord(op, node.name, start.name, wait.name, _between(start, wait)))
        elif isinstance(plan, _AsyncCollectivePlan):
            node.kwargs = {**node.kwargs, "async_op": True}
            touched = _aliases(_tensor_nodes((node.args, {k: v for k, v in node.kwargs.items()})))
            first_use = _first_use(node, touched)
            with graph.inserting_before(first_use):
                wait = graph.call_function(wait_work, (node,))
            if hoist:
                _hoist(node, sync_cls, None, touched)
            _pull_independent_work(gm, wait, {wait} | touched, sync_cls)
            report.records.append(OverlapRecord(op, node.name, node.name, wait.name, _between(node, wait)))
        else:
            producer = node.args[0] if node.args else None
            first_use = _first_use(node, [node])
            if first_use is not node.next:
                first_use.prepend(node)
            _pull_independent_work(gm, node, {node}, sync_cls)
            report.records.append(OverlapRecord(op, node.name, getattr(producer, "name", "?"), node.name,
                                                _between(producer, node) if isinstance(producer, fx.Node) else 0))
    graph.lint()
    for remove in unhook:  # only now: nothing is changed if anything above failed
        remove()
    gm.graph = graph
    gm.recompile()
    return report


def _explicit_sync_nodes(gm: fx.GraphModule, graph: fx.Graph, root: torch.nn.Module,
                         report: OverlapReport) -> List[Any]:
    """Turn the sync hooks of leaf ``torch.nn`` modules into call_module nodes of their SyncOp children.

    Returns the functions that remove the hooks (called once the new graph is installed).
    """
    from ...distributed.sync_ops import SyncHook

    removals: List[Any] = []
    uses: Dict[int, int] = {}
    for _, m in root.named_modules(remove_duplicate=False):
        uses[id(m)] = uses.get(id(m), 0) + 1
    calls: Dict[str, List[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls.setdefault(node.target, []).append(node)
    for target, nodes in calls.items():
        module = gm.get_submodule(target)
        post = dict(getattr(module, "_forward_hooks", {}))
        pre = dict(getattr(module, "_forward_pre_hooks", {}))
        syncs = [(k, h, "post") for k, h in post.items() if isinstance(h, SyncHook) and h.mode == "fwd_post"] + \
                [(k, h, "pre") for k, h in pre.items() if isinstance(h, SyncHook) and h.mode == "fwd_pre"]
        if not syncs:
            continue
        others = [h for h in list(post.values()) + list(pre.values()) if not isinstance(h, SyncHook)]
        if others or not type(module).__module__.startswith("torch.nn") or uses.get(id(module), 0) > 1:
            report.skipped.append(f"'{target}': its sync hooks share the module with other hooks or other callers")
            continue
        for node in nodes:
            if not node.args or not isinstance(node.args[0], fx.Node):
                continue
            for _, hook, where in syncs:
                child = f"{target}.{hook.child_name}"
                if where == "pre":
                    with graph.inserting_before(node):
                        synced = graph.call_module(child, (node.args[0],))
                    node.args = (synced,) + tuple(node.args[1:])
                else:
                    with graph.inserting_after(node):
                        synced = graph.call_module(child, (node,))
                    node.replace_all_uses_with(synced, delete_user_cb=lambda u: u is not synced)
        for key, _, where in syncs:
            tables = [getattr(module, name, {}) for name in (
                ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called") if where == "post"
                else ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"))]
            removals.append(lambda tables=tables, key=key: [t.pop(key, None) for t in tables])
    return removals


_RANDOM_WORDS = ("dropout", "rand", "bernoulli", "multinomial", "normal_", "uniform_", "exponential_", "poisson")


def _movable(gm: fx.GraphModule, node: fx.Node, sync_cls) -> bool:
    """Whether ``node`` can run earlier: plain computation, no communication, no side effects, no RNG."""
    if node.op == "get_attr":
        return True
    if node.op not in ("call_function", "call_method", "call_module") or _is_inplace(node):
        return False
    name = str(node.target) if node.op != "call_function" else getattr(node.target, "__name__", str(node.target))
    if any(word in name.lower() for word in _RANDOM_WORDS):
        return False
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if not type(module).__module__.startswith("torch.nn") or isinstance(module, torch.nn.Dropout) or \
                module._forward_hooks or module._forward_pre_hooks or (sync_cls and isinstance(module, sync_cls)):
            return False
        return not any(isinstance(m, torch.nn.modules.dropout._DropoutNd) for m in module.modules())
    return not _is_communication(node, sync_cls)


def _pull_independent_work(gm: fx.GraphModule, wait: fx.Node, dependent: Set[fx.Node], sync_cls) -> None:
    """Move the nodes after ``wait`` that do not need the collective to just before ``wait``.

    Scans forward from the wait; stops at the first node it may not move past (a collective,
    an in-place or random op, a module with hooks ...), so collectives and random numbers keep
    their program order.
    """
    dependent = set(dependent)
    to_move: List[fx.Node] = []
    node = wait.next
    while node.op != "output":
        if any(i in dependent for i in node.all_input_nodes):
            dependent.add(node)
            if not _movable(gm, node, sync_cls) and node.op != "get_attr":
                break
        elif _movable(gm, node, sync_cls):
            to_move.append(node)
        else:
            break
        node = node.next
    for n in to_move:
        wait.prepend(n)


def _first_use(after: fx.Node, tensors: Sequence[fx.Node]) -> fx.Node:
    """The first node after ``after`` that reads or writes one of ``tensors`` (else the output)."""
    watched = set(tensors)
    node = after.next
    while node.op != "output":
        if any(i in watched for i in node.all_input_nodes):
            return node
        node = node.next
    return node


def _hoist(start: fx.Node, sync_cls, companion: Optional[fx.Node], watched: Set[fx.Node] = frozenset()) -> None:
    """Move ``start`` (and the get_attr ``companion`` feeding it) up to just after its latest input.

    It passes only plain computation: not a collective or module call (collectives keep their
    order on every rank), not an in-place op, and not a node that uses one of ``watched``
    (the tensors an in-place collective writes).
    """
    inputs = set(start.all_input_nodes) - ({companion} if companion is not None else set())
    node = (companion or start).prev
    target = None
    while node.op not in ("root", "placeholder") and node not in inputs:
        if _is_communication(node, sync_cls) or _is_inplace(node) or any(i in watched for i in node.all_input_nodes):
            break
        target = node
        node = node.prev
    if target is not None:
        if companion is not None:
            target.prepend(companion)
        target.prepend(start)


def _between(start: fx.Node, wait: fx.Node) -> int:
    count, node = 0, start.next
    while node is not wait and node.op != "output":
        if node.op in ("call_function", "call_method", "call_module"):
            count += 1
        node = node.next
    return count

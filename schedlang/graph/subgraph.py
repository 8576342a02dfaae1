"""Subgraphs of traced modules: check them, and replace, fuse or checkpoint them.

A *subgraph* is what ``find`` returns: a list of ``(path, node)`` pairs, ``path`` naming
the traced module (relative to the schedule) whose graph holds ``node``. Primitives take
one subgraph or a list of them.

* :func:`validate_subgraphs` resolves and checks them before anything changes (every
  node exists, no subgraph spans two graphs, subgraphs do not overlap, taking a
  subgraph out of its graph creates no cycle).
* :func:`replace_subgraphs` replaces one or several subgraphs by one call of a module or
  function; its inputs are the subgraphs' inputs, its outputs their outputs, in order
  (several subgraphs at once is horizontal replacement, e.g. q/k/v -> one QKV module).
* :func:`fuse_subgraphs` lowers each subgraph to one module (``schedlang.lowering``).
* :func:`checkpoint_subgraph` recomputes a subgraph in backward.

Inputs of a subgraph are the values it reads from outside: other nodes, and parameters
(``get_attr`` nodes stay in the parent graph and are passed in, so a parameter keeps its
place, its shard record and its name). Outputs are its nodes used outside it, in graph
order. Every change is made on a copy of the graph that replaces the original only when
everything else succeeded, so a failed primitive leaves the module as it was.

For plans, :func:`encode_subgraphs` writes subgraphs as ``[[path, node_name], ...]``;
:func:`decode_subgraphs` reads them back, and the nodes are looked up by name when the
plan is replayed (node names are deterministic for the same model and steps).

Example::

    subgraphs = sch.find(lambda x, b: F.gelu(x + b))
    sch.replace(FastBiasGeLU(), target_ops=subgraphs)
"""

from __future__ import annotations

import copy
import heapq
import inspect
import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
from torch import nn

from ..errors import NotTracedError, PatternError, ScheduleTypeError, ScheduleValueError
from ..module_record import update_record
from ..utils.common import transfer_hooks
from .extract import ParamInput, extract_subgraph, has_hooks, has_sync, inputs_of, outputs_of

__all__ = [
    "validate_subgraphs",
    "replace_subgraphs",
    "fuse_subgraphs",
    "checkpoint_subgraph",
    "encode_subgraphs",
    "decode_subgraphs",
    "extract_subgraph",
    "CheckpointedSubgraph",
]

Subgraphs = List[List[Tuple[str, fx.Node]]]


# ---------------------------------------------------------------------------------------------
# structure and plan encoding
# ---------------------------------------------------------------------------------------------


def _is_pair(x: Any) -> bool:
    return isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], (fx.Node, str))


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _structure(subgraphs: Any, where: str, primitive: str) -> List[List[Tuple[str, Union[fx.Node, str]]]]:
    """One subgraph or a list of subgraphs, as a list of lists of pairs."""
    if _is_pair(subgraphs):
        return [[tuple(subgraphs)]]
    if isinstance(subgraphs, (list, tuple)):
        if not subgraphs:
            raise PatternError(f"{where}: {primitive} got an empty list of subgraphs (did find() match nothing?)")
        if all(_is_pair(x) for x in subgraphs):
            return [[tuple(x) for x in subgraphs]]
        if all(isinstance(x, (list, tuple)) and x and all(_is_pair(y) for y in x) for x in subgraphs):
            return [[tuple(y) for y in x] for x in subgraphs]
    raise ScheduleTypeError(
        f"{where}: {primitive} expects subgraphs as find() returns them: a list of (path, node) pairs, or a list "
        f"of such lists; got {_short(subgraphs)}")


def encode_subgraphs(subgraphs: Any) -> List[List[List[str]]]:
    """Subgraphs as JSON data: ``[[[path, node_name], ...], ...]``.

    Example: ``encode_subgraphs([[("", add), ("", gelu)]]) == [[["", "add"], ["", "gelu"]]]``.
    """
    return [[[path, node.name if isinstance(node, fx.Node) else node] for path, node in sg]
            for sg in _structure(subgraphs, "plan", "encode_subgraphs")]


def decode_subgraphs(data: Any) -> List[List[Tuple[str, str]]]:
    """Inverse of :func:`encode_subgraphs`: ``(path, node_name)`` pairs, resolved when applied."""
    return [[(path, name) for path, name in sg] for sg in _structure(data, "plan", "decode_subgraphs")]


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


def _where(sch) -> str:
    return sch.path or "<root>"


def require_traced(sch, primitive: str) -> fx.GraphModule:
    """``sch.mod`` if it is traced, else :class:`NotTracedError` saying to call ``.trace()``."""
    module = sch.mod
    if not isinstance(module, fx.GraphModule):
        call = f'sch["{sch.path}"].trace()' if sch.path else "sch.trace()"
        raise NotTracedError(f"{_where(sch)}: {primitive} needs a traced module, but this is {type(module).__name__}; "
                             f"call {call} first")
    return module


def _graph_module_at(sch, path: str, primitive: str) -> fx.GraphModule:
    root = sch.mod
    try:
        module = root.get_submodule(path) if path else root
    except AttributeError:
        raise ScheduleValueError(f"{_where(sch)}: a subgraph names module path '{path}', which does not exist "
                                 "under this schedule; pass subgraphs that find() returned on the same schedule") \
            from None
    if not isinstance(module, fx.GraphModule):
        full = ".".join(p for p in (sch.path, path) if p)
        raise NotTracedError(f"{full or '<root>'}: {primitive} needs a traced module, but this is "
                             f"{type(module).__name__}; call sch['{full}'].trace() first")
    return module


def _resolve(gm: fx.GraphModule, node: Union[fx.Node, str], path: str, where: str) -> fx.Node:
    if isinstance(node, fx.Node) and node.graph is gm.graph and not getattr(node, "_erased", False):
        return node
    name = node.name if isinstance(node, fx.Node) else node
    for candidate in gm.graph.nodes:
        if candidate.name == name:
            return candidate
    raise ScheduleValueError(
        f"{where}: no node named '{name}' in the graph of '{path or '<root>'}' (was it removed by an earlier fuse "
        "or replace? call find() again)")


def validate_subgraphs(sch, subgraphs: Any, primitive_name: str) -> Subgraphs:
    """Resolve ``subgraphs`` against ``sch`` and check them; raise before anything changes.

    Returns a list of subgraphs, each a list of ``(path, node)`` in graph order, with
    ``get_attr`` nodes left out (parameters stay in the parent graph as inputs).
    Raises NotTracedError (module not traced), ScheduleTypeError (not subgraphs),
    PatternError (empty) or ScheduleValueError (unknown node, overlap, cycle ...).
    """
    where = _where(sch)
    require_traced(sch, primitive_name)
    structure = _structure(subgraphs, where, primitive_name)
    owner_of: Dict[fx.Node, int] = {}
    result: Subgraphs = []
    for i, sg in enumerate(structure):
        paths = sorted({p for p, _ in sg})
        if len(paths) > 1:
            raise ScheduleValueError(
                f"{where}: subgraph {i} spans several traced modules ({', '.join(repr(p) for p in paths)}); a "
                "subgraph must lie in one graph (trace the common parent with flatten=True to work across modules)")
        path = paths[0]
        gm = _graph_module_at(sch, path, primitive_name)
        order = {n: k for k, n in enumerate(gm.graph.nodes)}
        nodes: List[fx.Node] = []
        for _, ref in sg:
            node = _resolve(gm, ref, path, where)
            if node.op in ("placeholder", "output"):
                raise ScheduleValueError(f"{where}: subgraph {i} contains the {node.op} node '{node.name}' of "
                                         f"'{path or '<root>'}'; a subgraph to {primitive_name} holds operations only")
            if node.op == "get_attr" or node in nodes:
                continue
            if node in owner_of:
                raise ScheduleValueError(f"{where}: node '{node.name}' is in subgraphs {owner_of[node]} and {i}; "
                                         "subgraphs must not overlap")
            owner_of[node] = i
            nodes.append(node)
        if not nodes:
            raise ScheduleValueError(f"{where}: subgraph {i} has no operation (only parameters)")
        nodes.sort(key=order.__getitem__)
        _check_no_cycle(nodes, where, f"subgraph {i}", primitive_name)
        if not outputs_of(nodes):
            raise ScheduleValueError(f"{where}: subgraph {i} ({', '.join(n.name for n in nodes)}) computes nothing "
                                     "that is used outside it; drop it, or match a subgraph whose result is used")
        result.append([(path, n) for n in nodes])
    if primitive_name == "replace" and len(result) > 1:
        paths = sorted({sg[0][0] for sg in result})
        if len(paths) > 1:
            raise ScheduleValueError(
                f"{where}: subgraphs replaced by one call must lie in one graph, but they are in "
                f"{', '.join(repr(p) for p in paths)}; replace each module's subgraphs separately")
        _check_no_cycle([n for sg in result for _, n in sg], where, "the subgraphs together", primitive_name)
    return result


def _check_no_cycle(nodes: Sequence[fx.Node], where: str, what: str, primitive: str) -> None:
    """Taking ``nodes`` out as one call is impossible if a path leaves the set and comes back."""
    inside = set(nodes)
    # nodes outside the set that depend on the set, and where they came from
    came_from: Dict[fx.Node, Tuple[fx.Node, fx.Node]] = {}
    stack = []
    for n in nodes:
        for user in n.users:
            if user not in inside and user not in came_from:
                came_from[user] = (n, user)
                stack.append(user)
    while stack:
        current = stack.pop()
        for user in current.users:
            if user in inside:
                start, first_outside = came_from[current]
                raise ScheduleValueError(
                    f"{where}: {primitive} of {what} would create a cycle: '{start.name}' feeds "
                    f"'{first_outside.name}' outside the subgraph, which feeds '{user.name}' inside it; add "
                    f"'{first_outside.name}' to the subgraph or split it")
            if user not in came_from:
                came_from[user] = came_from[current]
                stack.append(user)


# ---------------------------------------------------------------------------------------------
# extraction
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# rewriting a graph
# ---------------------------------------------------------------------------------------------


def _unique_name(gm: nn.Module, base: str, taken: set) -> str:
    k = 0
    while f"{base}_{k}" in gm._modules or hasattr(gm, f"{base}_{k}") or f"{base}_{k}" in taken:
        k += 1
    taken.add(f"{base}_{k}")
    return f"{base}_{k}"


class _GraphEdit:
    """Edits a copy of ``gm``'s graph; :meth:`commit` puts the copy in place."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.memo: Dict[Any, Any] = {}
        self.graph = _copy_graph(gm.graph, self.memo)
        self.new_modules: Dict[str, nn.Module] = {}
        self.dropped_targets: List[str] = []

    def node(self, original: fx.Node) -> fx.Node:
        return self.memo[original]

    def splice(self, nodes: Sequence[fx.Node], inputs: Sequence[Any], outputs: Sequence[fx.Node], op: str,
               target: Any, name: str, kwargs: Optional[Dict[str, Any]] = None) -> None:
        """Replace ``nodes`` by one call taking ``inputs`` and producing ``outputs`` (originals)."""
        graph = self.graph
        mine = [self.node(n) for n in nodes]
        inside = set(mine)
        with graph.inserting_before(mine[0]):
            args = []
            for value in inputs:
                if isinstance(value, ParamInput):
                    args.append(graph.get_attr(value.target))
                else:
                    args.append(self.node(value))
            call = graph.create_node(op, target, tuple(args), dict(kwargs or {}), name=name)
            results = [call] if len(outputs) == 1 else [
                graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
        for out, res in zip(outputs, results):
            self.node(out).replace_all_uses_with(res, delete_user_cb=lambda user: user not in inside)
        for n in reversed(mine):
            if n.op == "call_module":
                self.dropped_targets.append(n.target)
            graph.erase_node(n)

    def commit(self, drop_unused: bool) -> None:
        _stable_toposort(self.graph)
        self.graph.lint()
        for name, module in self.new_modules.items():
            self.gm.add_module(name, module)
        if drop_unused:
            referenced = [n.target for n in self.graph.nodes if n.op in ("call_module", "get_attr")]
            for target in dict.fromkeys(self.dropped_targets):
                if any(r == target or r.startswith(target + ".") for r in referenced):
                    continue
                parent_path, _, leaf = target.rpartition(".")
                if leaf.startswith("_schedlang_"):
                    continue
                parent = self.gm.get_submodule(parent_path) if parent_path else self.gm
                parent._modules.pop(leaf, None)
        self.gm.graph = self.graph  # last: nothing after this can fail


def _copy_graph(graph: fx.Graph, val_map: Dict[fx.Node, fx.Node]) -> fx.Graph:
    """A copy of ``graph``; ``val_map`` receives original node -> copied node."""
    new = fx.Graph(tracer_cls=graph._tracer_cls)
    output_val, old_output = new.graph_copy(graph, val_map=val_map, return_output_node=True)
    new._codegen = copy.deepcopy(graph._codegen)
    new_output = new.output(output_val, type_expr=getattr(old_output, "type", None))
    new_output.meta = copy.copy(old_output.meta)
    val_map[old_output] = new_output
    return new


def _stable_toposort(graph: fx.Graph) -> None:
    """Order nodes so every value is defined before use, moving as few as possible."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    missing = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(position[n], id(n), n) for n in nodes if missing[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for user in n.users:
            missing[user] -= 1
            if missing[user] == 0:
                heapq.heappush(ready, (position[user], id(user), user))
    if len(order) != len(nodes):  # pragma: no cover - validation rules cycles out
        raise ScheduleValueError("subgraph: internal error: the rewritten graph has a cycle; this should not "
                             "happen, please report it with the schedule that produced it")
    if order == nodes:
        return
    first = nodes[0]
    if order[0] is not first:
        first.prepend(order[0])
    for prev, nxt in zip(order, order[1:]):
        prev.append(nxt)


# ---------------------------------------------------------------------------------------------
# the three operations
# ---------------------------------------------------------------------------------------------


def _group_by_path(subgraphs: Subgraphs) -> Dict[str, List[List[fx.Node]]]:
    groups: Dict[str, List[List[fx.Node]]] = {}
    for sg in subgraphs:
        groups.setdefault(sg[0][0], []).append([n for _, n in sg])
    return groups


def _check_name(where: str, name: Any, primitive: str) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ScheduleValueError(f"{where}: {primitive} name must be a Python identifier (it names the new "
                                 f"submodule), got {name!r}")


def replace_subgraphs(sch, new_mod_or_fn: Union[nn.Module, Callable], subgraphs: Any,
                      name: Optional[str] = None, concrete_args: Optional[Dict[str, Any]] = None) -> None:
    """Replace ``subgraphs`` (all in one traced graph) by one call of ``new_mod_or_fn``.

    The call takes the subgraphs' inputs (each value once, in order of first use) and must
    return their outputs in order: one value for one output, else a sequence. A module is
    added as ``<name>_<k>`` (``name`` defaults to its class name); modules called only
    inside the subgraphs are dropped with their parameters.

    Example::

        qkv = sch["attn"].find(r"[qkv]_proj")           # three call_module nodes
        sch["attn"].replace(FusedQKV(), target_ops=qkv)  # one call returning (q, k, v)
    """
    where = _where(sch)
    normalized = validate_subgraphs(sch, subgraphs, "replace")
    path = normalized[0][0][0]
    gm = _graph_module_at(sch, path, "replace")
    node_lists = [[n for _, n in sg] for sg in normalized]
    all_nodes = [n for nodes in node_lists for n in nodes]
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    inputs = inputs_of(sorted(all_nodes, key=order.__getitem__))
    outputs = [o for nodes in node_lists for o in outputs_of(nodes)]
    is_module = isinstance(new_mod_or_fn, nn.Module)
    if not is_module and not callable(new_mod_or_fn):
        raise ScheduleTypeError(f"{where}: replace expects an nn.Module or a callable, got "
                                f"{type(new_mod_or_fn).__name__}")
    # plain hooks of one replaced chain move to the new module (see _hooks_to_move); sync points,
    # hooks in horizontal replacements and hooks a function cannot carry stay an error
    movable = is_module and len(node_lists) == 1
    for nodes in node_lists:
        for n in nodes:
            if n.op != "call_module":
                continue
            module = gm.get_submodule(n.target)
            if has_sync(module) or (not movable and has_hooks(module)):
                raise ScheduleValueError(
                    f"{where}: cannot replace '{n.name}': module '{n.target}' has hooks or sync points, which the "
                    "replacement would drop; leave it out of the subgraph, or remove its hooks first")
    hook_moves = _hooks_to_move(where, gm, node_lists[0]) if movable else []
    label = type(new_mod_or_fn).__name__ if is_module else getattr(new_mod_or_fn, "__name__", "function")
    concrete_args = dict(concrete_args or {})
    _check_arity(where, new_mod_or_fn, label, inputs, concrete_args)
    edit = _GraphEdit(gm)
    if is_module:
        base = name if name is not None else type(new_mod_or_fn).__name__
        _check_name(where, base, "replace")
        module_name = _unique_name(gm, base, set())
        edit.new_modules[module_name] = new_mod_or_fn
        edit.splice(sorted(all_nodes, key=order.__getitem__), inputs, outputs, "call_module", module_name,
                    module_name, concrete_args)
    else:
        edit.splice(sorted(all_nodes, key=order.__getitem__), inputs, outputs, "call_function", new_mod_or_fn,
                    getattr(new_mod_or_fn, "__name__", "replacement"), concrete_args)
    edit.commit(drop_unused=True)
    for old_module, kinds in hook_moves:
        transfer_hooks(old_module, new_mod_or_fn, kinds)


def _hooks_to_move(where: str, gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> List[Tuple[nn.Module, List[str]]]:
    """Which hooks of the modules in one replaced chain the new module takes over, as Slapo does.

    The chain's first module gives its pre-forward and backward hooks (they see the chain's
    input), its last module its forward hooks (they see the chain's output). A hook anywhere
    else would have to run inside the new module, so it is refused.
    """
    from ..utils.common import HOOK_TYPE_TO_ATTR, has_hook

    moves = []
    for i, n in enumerate(nodes):
        if n.op != "call_module":
            continue
        module = gm.get_submodule(n.target)
        first, last = i == 0, i == len(nodes) - 1
        allowed = (["fwd_pre", "bwd_post"] if first else []) + (["fwd_post"] if last else [])
        stuck = [k for k in HOOK_TYPE_TO_ATTR if k not in allowed and has_hook(module, k)]
        if stuck:
            place = "first" if first else "last" if last else "inner"
            raise ScheduleValueError(
                f"{where}: cannot replace '{n.name}': module '{n.target}' has {'/'.join(stuck)} hooks, which the "
                f"replacement cannot keep for the {place} module of the subgraph (only the first module's fwd_pre "
                "and bwd_post hooks and the last module's fwd_post hooks move to the new module)")
        if any(has_hook(module, k) for k in allowed):
            moves.append((module, allowed))
    return moves


def _check_arity(where: str, fn: Any, label: str, inputs: Sequence[Any],
                 concrete_args: Optional[Dict[str, Any]] = None) -> None:
    target = fn.forward if isinstance(fn, nn.Module) else fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*range(len(inputs)), **(concrete_args or {}))
    except TypeError as e:
        names = ", ".join(getattr(v, "name", getattr(v, "target", "?")) for v in inputs)
        given = f" and concrete_args {sorted(concrete_args)}" if concrete_args else ""
        hint = "; give the missing ones with concrete_args={name: value}" if "missing" in str(e) else ""
        raise ScheduleValueError(f"{where}: {label}{sig} cannot be called with the {len(inputs)} input(s) of the "
                                 f"subgraph(s) ({names}){given}: {e}{hint}") from None


def fuse_subgraphs(sch, subgraphs: Any, compiler: str, name: str) -> List[str]:
    """Lower each subgraph to one module ``<name>_<k>`` (see ``Schedule.fuse``); returns their paths."""
    from ..lowering import lower_subgraph

    where = _where(sch)
    normalized = validate_subgraphs(sch, subgraphs, "fuse")
    _check_name(where, name, "fuse")
    planned = []
    for path, node_lists in _group_by_path(normalized).items():
        gm = _graph_module_at(sch, path, "fuse")
        taken: set = set()
        for nodes in node_lists:
            # no compiler (Slapo's compiler=None): the subgraph's own modules move into one container
            body, inputs, outputs = extract_subgraph(gm, nodes, functionalize=compiler is not None, where=where,
                                                     primitive="fuse")
            module_name = _unique_name(gm, name, taken)
            if compiler is None:
                fused = _container(body, name)
            else:
                fused = lower_subgraph(body, compiler, module_name)  # may raise: nothing has changed yet
            update_record(fused, fused=True)
            planned.append((path, gm, nodes, inputs, outputs, module_name, fused))
    made = []
    edits: Dict[str, _GraphEdit] = {}
    for path, gm, nodes, inputs, outputs, module_name, fused in planned:
        edit = edits.setdefault(path, _GraphEdit(gm))
        edit.new_modules[module_name] = fused
        edit.splice(nodes, inputs, outputs, "call_module", module_name, module_name)
        made.append(".".join(p for p in (sch.path, path, module_name) if p))
    for edit in edits.values():
        edit.commit(drop_unused=True)
    return made


def _container(body: fx.GraphModule, class_name: str) -> fx.GraphModule:
    """The extracted subgraph as a module of class ``class_name`` whose children are the subgraph's modules,
    named ``"0"``, ``"1"`` ... in the order the graph calls them (what Slapo's ``fuse(compiler=None)`` makes)."""
    graph = copy.deepcopy(body.graph)
    children: Dict[str, nn.Module] = {}
    renamed: Dict[str, str] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            if node.target not in renamed:
                renamed[node.target] = str(len(renamed))
                children[renamed[node.target]] = body.get_submodule(node.target)
            node.target = renamed[node.target]
    for node in graph.nodes:
        if node.op == "get_attr":
            children[node.target.replace(".", "_")] = _attribute(body, node.target)
            node.target = node.target.replace(".", "_")
    return fx.GraphModule(children, graph, class_name=class_name)


def _attribute(module: nn.Module, dotted: str):
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


#: base name of the modules that run checkpointed subgraphs (``CheckPointWrapper_0`` ..., as Slapo names them)
CHECKPOINT_WRAPPER_NAME = "CheckPointWrapper"


class CheckpointedSubgraph(nn.Module):
    """Runs a subgraph of a traced module under ``torch.utils.checkpoint`` (non-reentrant).

    The subgraph's modules stay registered where they were in the parent (the body refers
    to them without owning them), and parameters come in as inputs, so names, shards and
    the state dict do not change.
    """

    def __init__(self, body: fx.GraphModule):
        super().__init__()
        update_record(self, checkpointed=True)
        self.__dict__["body"] = body
        self.input_names = [n.name for n in body.graph.nodes if n.op == "placeholder"]

    @property
    def mod(self) -> fx.GraphModule:
        """The checkpointed body (Slapo's name for the wrapped module)."""
        return self.body

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.body(*args)
        return torch.utils.checkpoint.checkpoint(self.body, *args, use_reentrant=False)

    def extra_repr(self) -> str:
        return f"inputs=({', '.join(self.input_names)})"


def checkpoint_subgraph(sch, subgraph: Any) -> None:
    """Recompute ``subgraph`` (or each of several) in backward instead of keeping its activations.

    Example::

        attn = sch.find(scaled_dot_product)
        sch.checkpoint(attn)
    """
    normalized = validate_subgraphs(sch, subgraph, "checkpoint")
    where = _where(sch)
    planned = []
    for path, node_lists in _group_by_path(normalized).items():
        gm = _graph_module_at(sch, path, "checkpoint")
        taken: set = set()
        for nodes in node_lists:
            body, inputs, outputs = extract_subgraph(gm, nodes, functionalize=False, where=where,
                                                     primitive="checkpoint")
            planned.append((path, gm, nodes, inputs, outputs, _unique_name(gm, CHECKPOINT_WRAPPER_NAME, taken), body))
    edits: Dict[str, _GraphEdit] = {}
    for path, gm, nodes, inputs, outputs, module_name, body in planned:
        edit = edits.setdefault(path, _GraphEdit(gm))
        edit.new_modules[module_name] = CheckpointedSubgraph(body)
        edit.splice(nodes, inputs, outputs, "call_module", module_name, module_name)
    for edit in edits.values():
        edit.commit(drop_unused=False)

"""Reading a module's ``forward`` source: which attributes it reads, how its projections feed each other.

Shard rules and the automatic tensor-parallel plan need three facts about a module class that
its type does not tell, and that its code does:

* :func:`attribute_reads` - the ``self.<attr>`` and ``self.<config>.<attr>`` names that
  ``forward`` reads (and the methods of ``self`` it calls, transitively): an attention module
  that reshapes with ``self.num_heads`` must have that attribute set to the local head count;
* :func:`projection_dataflow` - for each projection child called in ``forward``, which other
  projection children its input was computed from (``o_proj`` from ``q_proj``, ``k_proj`` and
  ``v_proj``; ``down_proj`` from ``gate_proj`` and ``up_proj``), by following names through the
  assignments of ``forward``;
* :func:`first_consumer` - what ``forward`` does first with a projection's output: a reshape into
  heads (``view`` / ``reshape``: the fused q|k|v is laid out head by head) or a split into parts
  (``chunk`` / ``split`` / slicing: the parts are stored one after the other).

All three work on the class's source (``inspect`` + ``ast``) and are cached per class; a class
whose source cannot be read gives ``None`` and the caller decides what that means (rules refuse
what they cannot check).
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

from torch import nn

__all__ = ["attribute_reads", "projection_dataflow", "first_consumer", "first_parameter", "passes_first",
           "is_projection", "is_conv1d"]

logger = logging.getLogger("schedlang.distributed.shard_rules.forward_code")

#: what ``forward`` may do first with a projection's output, by kind of layout it implies
_RESHAPES = {"view", "reshape", "unflatten"}
_SPLITS = {"chunk", "split", "tensor_split", "unbind", "narrow", "split_with_sizes"}
_INERT = {"shape", "size", "dtype", "device", "dim", "ndim"}


def is_conv1d(module: nn.Module) -> bool:
    """HF's ``Conv1D`` (weight stored as (in, out)), matched by name so transformers need not be imported."""
    return any(k.__name__ == "Conv1D" for k in type(module).__mro__)


def is_projection(module: nn.Module) -> bool:
    """A module tensor parallelism splits column- or row-wise: an ``nn.Linear`` (or subclass) or a Conv1D."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


@functools.lru_cache(maxsize=None)
def _function(klass: type, name: str) -> Optional[ast.FunctionDef]:
    fn = getattr(klass, name, None)
    if fn is None or not callable(fn):
        return None
    fn = inspect.unwrap(fn)
    if (getattr(fn, "__module__", None) or "").startswith("torch.nn.modules.module"):
        return None  # nn.Module's own methods (__call__, ...) carry no model logic
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    for parent in ast.walk(node):
        for child in ast.iter_child_nodes(parent):
            child._parent = parent  # type: ignore[attr-defined]
    return node


def _self_name(fn: ast.FunctionDef) -> Optional[str]:
    return fn.args.args[0].arg if fn.args.args else None


def _is_self_attr(node: ast.AST, self_name: str) -> Optional[str]:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == self_name:
        return node.attr
    return None


@functools.lru_cache(maxsize=None)
def attribute_reads(klass: type) -> Optional[Tuple[FrozenSet[str], FrozenSet[str]]]:
    """``(self_attributes, config_attributes)`` read by ``klass.forward`` and the methods of ``self`` it
    calls; ``None`` when the source cannot be read. ``self.config.x`` and ``getattr(self.config, "x")``
    count as config reads of ``x`` (``config`` itself is then also a self read)."""
    if _function(klass, "forward") is None:
        return None
    own, config = set(), set()
    seen: Set[str] = set()
    todo = ["forward"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        fn = _function(klass, name)
        if fn is None:
            continue
        me = _self_name(fn)
        for node in ast.walk(fn):
            attr = _is_self_attr(node, me)
            if attr is None:
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                        and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                        and isinstance(node.args[1].value, str)):
                    target = node.args[0]
                    if isinstance(target, ast.Name) and target.id == me:
                        own.add(node.args[1].value)
                    elif _is_self_attr(target, me) == "config":
                        config.add(node.args[1].value)
                continue
            parent = getattr(node, "_parent", None)
            if isinstance(parent, ast.Attribute) and attr == "config":
                config.add(parent.attr)
            own.add(attr)
            if isinstance(parent, ast.Call) and parent.func is node and inspect.isfunction(
                    inspect.unwrap(getattr(klass, attr, None) or (lambda: None))):
                todo.append(attr)  # a helper method of the module: its reads count too
    return frozenset(own), frozenset(config)


def first_parameter(klass: type) -> Optional[str]:
    """The name of ``forward``'s first argument after ``self`` (the block's input, for HF blocks)."""
    fn = _function(klass, "forward")
    if fn is None or len(fn.args.args) < 2:
        return None
    return fn.args.args[1].arg


class _Taint(ast.NodeVisitor):
    """Follows which projection outputs each name of a function may hold, statement by statement
    (after an ``if``, a name holds what either branch gave it)."""

    def __init__(self, self_name: str, projections: Set[str], watched: Set[str] = frozenset()):
        self.me = self_name
        self.projections = projections
        self.watched = watched  # children whose inputs are recorded, their outputs carrying the inputs' sets
        self.env: Dict[str, Set[str]] = {}
        self.inputs: Dict[str, Set[str]] = {}
        self.args: Dict[str, List[ast.AST]] = {}

    def taint(self, node: Optional[ast.AST]) -> Set[str]:
        if node is None:
            return set()
        if isinstance(node, ast.Name):
            return set(self.env.get(node.id, ()))
        if isinstance(node, ast.Call):
            attr = _is_self_attr(node.func, self.me)
            inputs = set()
            for a in list(node.args) + [k.value for k in node.keywords]:
                inputs |= self.taint(a)
            if attr in self.projections:
                self.inputs.setdefault(attr, set()).update(inputs)
                self.args.setdefault(attr, []).extend(node.args[:1] or [k.value for k in node.keywords[:1]])
                return {attr}
            if attr in self.watched:
                self.inputs.setdefault(attr, set()).update(inputs)
            return inputs | self.taint(node.func)
        if isinstance(node, (ast.Lambda, ast.FunctionDef)):
            return set()
        out: Set[str] = set()
        for child in ast.iter_child_nodes(node):
            out |= self.taint(child)
        return out

    def _bind(self, target: ast.AST, taint: Set[str], replace: bool = True) -> None:
        # a plain assignment replaces what a name held (``h = self.fc1(h)``: h now holds fc1's output only);
        # what either branch of an ``if`` assigned is merged in visit_If
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                if replace:
                    self.env[node.id] = set(taint)
                else:
                    self.env.setdefault(node.id, set()).update(taint)

    def visit_Assign(self, node):
        t = self.taint(node.value)
        for target in node.targets:
            self._bind(target, t)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self._bind(node.target, self.taint(node.value))

    def visit_AugAssign(self, node):
        self._bind(node.target, self.taint(node.value), replace=False)

    def visit_For(self, node):
        self._bind(node.target, self.taint(node.iter), replace=False)
        for stmt in node.body + node.orelse:
            self.visit(stmt)

    def visit_With(self, node):
        for item in node.items:
            t = self.taint(item.context_expr)
            if item.optional_vars is not None:
                self._bind(item.optional_vars, t)
        for stmt in node.body:
            self.visit(stmt)

    def visit_If(self, node):
        # each branch starts from the state before the ``if``; afterwards a name may hold what either gave it
        self.taint(node.test)
        before = {k: set(v) for k, v in self.env.items()}
        for stmt in node.body:
            self.visit(stmt)
        after_body, self.env = self.env, before
        for stmt in node.orelse:
            self.visit(stmt)
        for k, v in after_body.items():
            self.env.setdefault(k, set()).update(v)

    def visit_Expr(self, node):
        self.taint(node.value)

    def visit_Return(self, node):
        self.taint(node.value)

    def generic_visit(self, node):
        if isinstance(node, ast.stmt):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    self.visit(child)
                elif isinstance(child, ast.expr):
                    self.taint(child)


def projection_dataflow(klass: type, projections) -> Optional[Dict[str, FrozenSet[str]]]:
    """For each projection child (name) that ``klass.forward`` calls, the projections whose outputs its
    input may be computed from; ``None`` without source. A projection ``forward`` never calls is absent."""
    fn = _function(klass, "forward")
    if fn is None:
        return None
    visitor = _Taint(_self_name(fn), set(projections))
    for stmt in fn.body:
        visitor.visit(stmt)
    return {name: frozenset(inputs - {name}) for name, inputs in visitor.inputs.items()}


def child_inputs(klass: type, projections, watched) -> Optional[Dict[str, FrozenSet[str]]]:
    """For each ``watched`` child that ``klass.forward`` calls, the projections its input may be computed
    from (a norm applied to the heads of ``q_proj``'s output: ``{"q_proj"}``); ``None`` without source."""
    fn = _function(klass, "forward")
    if fn is None:
        return None
    visitor = _Taint(_self_name(fn), set(projections), set(watched))
    for stmt in fn.body:
        visitor.visit(stmt)
    return {name: frozenset(visitor.inputs.get(name, ())) for name in watched}


def projection_arguments(klass: type, projections) -> Dict[str, List[ast.AST]]:
    """The first argument expressions of every call of each projection in ``forward``."""
    fn = _function(klass, "forward")
    if fn is None:
        return {}
    visitor = _Taint(_self_name(fn), set(projections))
    for stmt in fn.body:
        visitor.visit(stmt)
    return visitor.args


def _consumer_of(node: ast.AST) -> Tuple[Optional[str], Optional[ast.AST]]:
    """What is done with the value of ``node``: ("reshape" | "split", None), ("name", assigned Name), or
    ("call_arg", the Call) when it is passed to a call."""
    parent = getattr(node, "_parent", None)
    if isinstance(parent, ast.Attribute) and parent.value is node:
        if parent.attr in _RESHAPES:
            return "reshape", None
        if parent.attr in _SPLITS:
            return "split", None
        return None, None
    if isinstance(parent, ast.Subscript) and parent.value is node:
        return "split", None
    if isinstance(parent, ast.Assign) and parent.value is node and len(parent.targets) == 1 \
            and isinstance(parent.targets[0], ast.Name):
        return "name", parent.targets[0]
    if isinstance(parent, ast.Call) and node in parent.args:
        return "call_arg", parent
    return None, None


def _follow_name(klass: type, fn: ast.FunctionDef, name: str, after_line: int, depth: int) -> Optional[str]:
    uses = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name
                   and isinstance(n.ctx, ast.Load) and n.lineno >= after_line),
                  key=lambda n: (n.lineno, n.col_offset))
    for use in uses:
        parent = getattr(use, "_parent", None)
        if isinstance(parent, ast.Attribute) and parent.attr in _INERT:
            continue
        return _classify(klass, fn, use, depth)
    return None


def _classify(klass: type, fn: ast.FunctionDef, node: ast.AST, depth: int) -> Optional[str]:
    kind, extra = _consumer_of(node)
    if kind in ("reshape", "split"):
        return kind
    if kind == "name":
        return _follow_name(klass, fn, extra.id, node._parent.end_lineno + 1, depth)
    if kind == "call_arg" and depth < 3:
        call = extra
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in _SPLITS:  # torch.split(x, ...) / torch.chunk(x, ...)
            return "split"
        if isinstance(func, ast.Attribute) and func.attr in _RESHAPES:
            return "reshape"
        method = _is_self_attr(func, _self_name(fn))
        callee = _function(klass, method) if method else None
        if callee is not None:  # a helper of the module (Falcon's _split_heads): follow the parameter
            index = call.args.index(node) + 1
            if index < len(callee.args.args):
                return _follow_name(klass, callee, callee.args.args[index].arg, 0, depth + 1)
    return None


@functools.lru_cache(maxsize=None)
def first_consumer(klass: type, projection: str) -> Optional[str]:
    """``"reshape"`` if ``forward`` first reshapes the output of ``self.<projection>(...)`` (into heads),
    ``"split"`` if it first splits or slices it into parts, ``None`` when that cannot be told."""
    fn = _function(klass, "forward")
    if fn is None:
        return None
    me = _self_name(fn)
    found = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and _is_self_attr(node.func, me) == projection:
            found.add(_classify(klass, fn, node, 0))
    return found.pop() if len(found) == 1 else None


def passes_first(caller: type, child: str, parameter: str) -> bool:
    """Whether every call ``self.<child>(...)`` in ``caller.forward`` passes the block input first: a
    positional first argument, or ``parameter=`` as the first keyword (the tensor a ``bwd_post`` sync
    on the child acts on)."""
    fn = _function(caller, "forward")
    if fn is None:
        return False
    me = _self_name(fn)
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and _is_self_attr(n.func, me) == child]
    if not calls:
        return False
    for call in calls:
        if call.args and not isinstance(call.args[0], ast.Starred):
            continue
        if call.keywords and call.keywords[0].arg == parameter:
            continue
        return False
    return True

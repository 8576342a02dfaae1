"""Slapo's tree and graph queries on a schedule: plain methods of ``Schedule``, not primitives.

They look at the schedule and record nothing, except that the graph queries trace a module not traced
yet (a ``trace`` step, as ``find`` does), and ``update_submodule``, which changes the model through
``replace``. ``Schedule`` (:mod:`schedlang.schedule`) inherits them; they use only its public view
(``mod``, ``root``, ``find``, ``replace``, ``atomic``) and its display name.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Sequence, Union

import torch.fx as fx
from torch import nn

from .errors import ArgumentTypeError, PatternError, ScheduleKeyError, ScheduleTypeError, ScheduleValueError

__all__ = ["ScheduleQueries", "INTERNAL_CHILD", "join_path", "list_names"]

#: children that schedlang adds to a module (sync points), never shown as the user's submodules
INTERNAL_CHILD = re.compile(r"^_schedlang_")


def join_path(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` at the root."""
    return f"{prefix}.{name}" if prefix else name


def list_names(valid: Sequence[str]) -> str:
    """Submodule names for an error message: the first twenty, or what a leaf has."""
    if not valid:
        return "none (a leaf module)"
    return ", ".join(valid[:20]) + (", ..." if len(valid) > 20 else "")


class ScheduleQueries:
    """Slapo's queries, mixed into ``Schedule``."""

    def get_top_schedule(self) -> "ScheduleQueries":
        """The schedule of the whole model (Slapo's name for :attr:`root`).

        Example::

            sch["layers.0.mlp"].get_top_schedule() is not None   # same plan as sch
        """
        return self.root

    @staticmethod
    def tokenize_module_path(module_path: str) -> list:
        """Split a dotted path into Slapo's child names: an index joins the name before it, as
        Slapo names the children of a ``ModuleList`` (``"layers.0"``). ``""`` has no tokens.

        Example::

            Schedule.tokenize_module_path("layers.0.mlp.fc1")   # ['layers.0', 'mlp', 'fc1']
        """
        if not isinstance(module_path, str):
            raise ScheduleTypeError(f"tokenize_module_path: expects a dotted module path like 'layers.0.mlp', got "
                                    f"{type(module_path).__name__} {module_path!r}")
        if not module_path:
            return []
        tokens: list = []
        for part in module_path.split("."):
            if part.isdigit():
                if not tokens:
                    raise ScheduleValueError(
                        f"tokenize_module_path: {module_path!r} starts with the index '{part}'; a path starts with "
                        "a submodule name, e.g. 'layers.0' (an index follows the ModuleList it indexes)")
                tokens[-1] = f"{tokens[-1]}.{part}"
            else:
                tokens.append(part)
        return tokens

    def get_module(self, name: str) -> nn.Module:
        """The submodule called ``name`` relative to this schedule (``""``: :attr:`mod` itself),
        e.g. the module a ``call_module`` node of this traced module calls.

        Example::

            node = sch["mlp"].find_node(r"fc1")[0][1]
            sch["mlp"].get_module(node.target)   # the Linear
        """
        if not isinstance(name, str):
            raise ScheduleTypeError(f"{self._display()}: get_module expects a submodule name like 'mlp.fc1', got "
                                    f"{type(name).__name__} {name!r}")
        module = self.mod
        if not name:
            return module
        try:
            return module.get_submodule(name)
        except AttributeError:
            valid = [n for n, _ in module.named_modules() if n and not any(INTERNAL_CHILD.match(p)
                                                                             for p in n.split("."))]
            raise ScheduleKeyError(f"{self._display()}: get_module: no submodule '{name}' here (names are relative "
                                   f"to this schedule's path); valid names: {list_names(valid)}") from None

    def find_node(self, regex_or_pattern_fn: Union[str, Callable[[fx.Node], bool]]) -> list:
        """Nodes of this module's graphs, as ``[(path, node), ...]`` (``path``: the traced module
        holding ``node``, relative to this schedule). A regex selects the ``call_module`` nodes
        whose target matches it from the start (``re.match``); a function ``node -> bool``
        selects the nodes it accepts. A module not traced yet is traced first (see ``find``).

        Example::

            sch.find_node(r"fc\\d")                                          # the Linear calls
            sch.find_node(lambda n: n.op == "call_function" and n.target is torch.add)
        """
        from .graph.pattern import graph_modules
        from .primitives.find import trace_on_demand

        where = self._display()
        query = regex_or_pattern_fn
        if isinstance(query, str):
            try:
                compiled = re.compile(query)
            except re.error as e:
                raise PatternError(f"{where}: find_node got an invalid regex {query!r}: {e}") from e

            def accepts(node: fx.Node) -> bool:
                return node.op == "call_module" and compiled.match(str(node.target)) is not None
        elif callable(query) and not isinstance(query, (type, nn.Module)):
            accepts = query
        else:
            raise ArgumentTypeError(f"{where}: find_node expects a regex string or a function node -> bool, got "
                                    f"{type(query).__name__} {query!r}; to match a subgraph pattern use "
                                    "find_subgraph")
        found = []
        # all-or-nothing, as find() is: a predicate that raises must not leave behind the trace made for it
        # (a module traced already has nothing to undo, and skips the snapshot of every module's attributes)
        tracing = not isinstance(self.mod, fx.GraphModule)
        with self.atomic() if tracing else contextlib.nullcontext():
            trace_on_demand(self, "find_node")
            for path, gm in graph_modules(self.mod):
                for node in gm.graph.nodes:
                    try:
                        hit = accepts(node)
                    except Exception as e:
                        raise PatternError(f"{where}: find_node's function raised {type(e).__name__}: {e} on node "
                                           f"'{node.name}' (op {node.op}) of the graph at '{path or '<root>'}'; it "
                                           "must return True or False for every node") from e
                    if hit:
                        found.append((path, node))
        return found

    def find_subgraph(self, pattern_fn: Callable[..., Any]) -> list:
        """Subgraphs computing what ``pattern_fn`` computes (a function or ``nn.Module``), matched by
        dataflow: ``[[(path, node), ...], ...]``, as ``find`` returns for a pattern. A module not
        traced yet is traced first.

        Example::

            sch.find_subgraph(lambda x, bias: F.gelu(bias + x))
        """
        if isinstance(pattern_fn, str) or not callable(pattern_fn):
            raise ArgumentTypeError(f"{self._display()}: find_subgraph expects a pattern function or an nn.Module, "
                                    f"got {type(pattern_fn).__name__} {pattern_fn!r}; to select nodes by a regex "
                                    "over module names use find_node")
        return self.find(pattern_fn)

    def trace_until(self, paths: Union[str, Sequence[str]], **kwargs: Any) -> None:
        """Trace this module down to the submodules at ``paths`` (relative to this schedule, ``""``
        for this module): they are traced too, and their children stay calls. Slapo uses it to
        expose a model's layers, e.g. as pipeline cut points. Recorded as one ``trace`` step
        (``leaf_modules`` = those children); ``leaf_modules`` and ``concrete_args`` may be given,
        ``tracer`` may be Slapo's ``"pytorch"`` or ``"huggingface"`` (both the same tracer here).
        A submodule on the way that cannot be traced stays a call too (logged at INFO and listed
        in the step's ``leaf_modules``); this module itself failing is a ``TraceError``.

        Example::

            sch.trace_until("layers")          # root and 'layers' traced, 'layers.0', ... stay calls
            sch["layers.3"].cut_pipeline_stage()
        """
        from .trace_levels import trace_until

        trace_until(self, paths, **kwargs)

    def update_submodule(self, mod: nn.Module, submod_name: str, new_submod: nn.Module) -> None:
        """Put ``new_submod`` in place of the child ``submod_name`` (a dotted path, e.g. ``"layers.0"``)
        of ``mod``, a module of this schedule's model (``sch.mod``, ``sch.parent.mod`` ...). The
        change is a ``replace`` step of the plan, so it is checked, recorded and replayed like
        any other.

        Example::

            sch.update_submodule(sch["mlp"].mod, "act", nn.ReLU())   # == sch["mlp.act"].replace(nn.ReLU())
        """
        where = self._display()
        if not isinstance(submod_name, str) or not submod_name:
            raise ScheduleTypeError(f"{where}: update_submodule expects the child's name (a non-empty dotted path "
                                    f"like 'layers.0'), got {submod_name!r}")
        owner = next((p for p, m in self._state.module.named_modules(remove_duplicate=False) if m is mod), None)
        if owner is None:
            raise ScheduleValueError(
                f"{where}: update_submodule got a {type(mod).__name__} that is not part of this schedule's model; "
                "pass sch.mod or a module under it (the schedule works on a copy: the model given to "
                "create_schedule is never changed)")
        self.root[join_path(owner, submod_name)].replace(new_submod)

"""``find(regex_or_pattern_fn)``: a query on the traced module (not a plan step).

* A regex string: the ``call_module`` nodes whose module name (relative to this path)
  matches it (``re.search``), as ``[(path, node), ...]``.
* A pattern function, ``nn.Module`` or ``nn.Module`` subclass: the non-overlapping
  subgraphs computing the same thing, matched by dataflow, as
  ``[[(path, node), ...], ...]`` (see :mod:`schedlang.graph.pattern`).

``path`` names the traced module holding the node, relative to this schedule, so results
from a hierarchically traced model point into the children's graphs. Pass the result to
``fuse``, ``replace(target_ops=...)`` or ``checkpoint(subgraph)`` on the same schedule.

A module that is not traced yet is traced first, as Slapo does: ``trace()`` with its
defaults (hierarchy kept, ``flatten=False``), recorded in the plan as its own step. When
that tracing fails, :class:`~schedlang.NotTracedError` says why; call ``trace`` yourself
with ``leaf_modules`` or ``concrete_args`` then (or ``flatten=True`` to match across
module boundaries).

Example::

    sch.trace(flatten=True)
    sch.find(r"linear\\d")                         # [('', linear2)]
    sch.find(lambda x, b: F.gelu(b + x))          # [[('', add), ('', activation)]]
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Union

from ..errors import NotTracedError, PatternError, TraceError
from .base import Param, Primitive, register_primitive

__all__ = ["Find", "trace_on_demand"]

logger = logging.getLogger("schedlang.primitives.find")


def trace_on_demand(sch, primitive: str) -> None:
    """Trace ``sch`` with ``trace()``'s defaults unless it is traced already (a plan step of its own).

    Queries trace what they search, as Slapo's do; only a tracing failure stops them, with a
    :class:`NotTracedError` that carries the tracer's reason and says how to trace by hand.
    """
    import torch.fx as fx

    if isinstance(sch.mod, fx.GraphModule):
        return
    where = sch.path or "<root>"
    call = f'sch["{sch.path}"].trace(...)' if sch.path else "sch.trace(...)"
    try:
        sch.trace()
    except TraceError as e:
        raise NotTracedError(
            f"{where}: {primitive} needs a traced module, and tracing this {type(sch.mod).__name__} on demand "
            f"(trace() with its defaults) failed: {e}; call {call} with leaf_modules= or concrete_args= "
            "first") from e
    logger.info("%s: %s traced this module on demand (trace(flatten=False), recorded as step %d)", where,
                primitive, len(sch.plan) - 1)


@register_primitive
class Find(Primitive):
    """Find nodes of the traced module: a regex over module names, or a pattern function
    matched by dataflow (returns a list of subgraphs). A query: nothing is recorded, except
    the ``trace()`` step that traces a module not traced yet.

    Example::

        subgraphs = sch["mlp"].find(lambda x, b: F.gelu(x + b))
    """

    name = "find"
    records_step = False
    params = (
        Param("regex_or_pattern_fn", Union[str, Callable[..., Any]],
              doc="a regex over module names, or a pattern function / nn.Module matched by dataflow",
              type_error="{where}: find expects a regex string, a pattern function or an nn.Module, "
                         "got {type_name}"),
    )

    @classmethod
    def validate(cls, sch, regex_or_pattern_fn):
        from ..graph.pattern import trace_pattern

        where = sch.path or "<root>"
        pattern = regex_or_pattern_fn
        traced = None
        # the query is checked before anything is traced, so a bad one changes nothing
        if isinstance(pattern, str):
            try:
                re.compile(pattern)
            except re.error as e:
                raise PatternError(f"{where}: find got an invalid regex {pattern!r}: {e}") from e
        else:
            try:
                traced = trace_pattern(pattern)
            except PatternError as e:
                raise PatternError(f"{where}: {e}; pass a regex, or a function FX can trace") from e.__cause__
        trace_on_demand(sch, "find")
        return {"regex_or_pattern_fn": pattern, "_pattern_graph": traced}

    @classmethod
    def apply(cls, sch, regex_or_pattern_fn, _pattern_graph=None):
        from ..graph.pattern import find_nodes, find_subgraphs

        if _pattern_graph is None:
            return find_nodes(sch.mod, regex_or_pattern_fn)
        return find_subgraphs(sch.mod, _pattern_graph)

"""``find(regex_or_pattern_fn)``: a query on the traced module (not a plan step).

* A regex string: the ``call_module`` nodes whose module name (relative to this path)
  matches it (``re.search``), as ``[(path, node), ...]``.
* A pattern function, ``nn.Module`` or ``nn.Module`` subclass: the non-overlapping
  subgraphs computing the same thing, matched by dataflow, as
  ``[[(path, node), ...], ...]`` (see :mod:`schedlang.graph.pattern`).

``path`` names the traced module holding the node, relative to this schedule, so results
from a hierarchically traced model point into the children's graphs. Pass the result to
``fuse``, ``replace(target_ops=...)`` or ``checkpoint(subgraph)`` on the same schedule.

Example::

    sch.trace(flatten=True)
    sch.find(r"linear\\d")                         # [('', linear2)]
    sch.find(lambda x, b: F.gelu(b + x))          # [[('', add), ('', activation)]]
"""

from __future__ import annotations

import re

from typing import Any, Callable, Union

from ..errors import PatternError
from .base import Param, Primitive, register_primitive

__all__ = ["Find"]


@register_primitive
class Find(Primitive):
    """Find nodes of the traced module: a regex over module names, or a pattern function
    matched by dataflow (returns a list of subgraphs). A query: nothing is recorded.

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
        from ..graph.subgraph import require_traced

        where = sch.path or "<root>"
        require_traced(sch, "find")
        pattern = regex_or_pattern_fn
        if isinstance(pattern, str):
            try:
                re.compile(pattern)
            except re.error as e:
                raise PatternError(f"{where}: find got an invalid regex {pattern!r}: {e}") from e
            return {"regex_or_pattern_fn": pattern, "_pattern_graph": None}
        try:
            traced = trace_pattern(pattern)
        except PatternError as e:
            raise PatternError(f"{where}: {e}") from e.__cause__
        return {"regex_or_pattern_fn": pattern, "_pattern_graph": traced}

    @classmethod
    def apply(cls, sch, regex_or_pattern_fn, _pattern_graph=None):
        from ..graph.pattern import find_nodes, find_subgraphs

        if _pattern_graph is None:
            return find_nodes(sch.mod, regex_or_pattern_fn)
        return find_subgraphs(sch.mod, _pattern_graph)

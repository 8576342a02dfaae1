"""Modules whose forward never runs because a traced ancestor inlined them.

``trace(flatten=True)`` turns a module's forward, and the forwards of the containers inside it, into
one graph that calls only its leaf modules (``call_module`` nodes such as ``self.query``). The
containers stay in the module tree, and their paths stay valid: their parameters are the leaves'
ones, and the leaves are scheduled through them. But their own ``forward`` is never called any more,
so a primitive that acts through it (a hook of ``sync``, ``checkpoint``, a ``replace`` of the
container, a ``trace`` of it) would do nothing, or break the graph that reaches its leaves through it.
The same holds for a module the graph does not use at all (one a ``replace`` of a subgraph left behind).

:func:`inlined_by_trace` tells such a module from one that runs.

Example::

    sch["encoder.layer.0.attention"].trace(flatten=True)
    inlined_by_trace(model, "encoder.layer.0.attention.self")
    # Inlined(traced="encoder.layer.0.attention", calls=["self.query", "self.key", "self.value"])
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch.fx as fx
from torch import nn

__all__ = ["Inlined", "inlined_by_trace"]


@dataclasses.dataclass
class Inlined:
    """Where a module's forward was inlined: the traced ancestor's path and the modules inside the inlined one
    that its graph calls instead (paths relative to the ancestor; empty when it uses nothing inside)."""

    traced: str
    calls: List[str]


def inlined_by_trace(root: nn.Module, path: str) -> Optional[Inlined]:
    """:class:`Inlined` if the module at ``path`` (under ``root``) never runs because the graph of a traced
    ancestor (an ``fx.GraphModule``) neither calls it nor calls a module that holds it; None if it runs."""
    if not path:
        return None
    parts = path.split(".")
    module = root
    for depth, part in enumerate(parts):
        if isinstance(module, fx.GraphModule):
            below = ".".join(parts[depth:])
            targets = [str(n.target) for n in module.graph.nodes if n.op == "call_module"]
            if not any(below == t or below.startswith(t + ".") for t in targets):
                return Inlined(traced=".".join(parts[:depth]),
                               calls=[t for t in targets if t.startswith(below + ".")])
        module = module._modules.get(part)
        if module is None:
            return None  # not a module path: the lookup that made the schedule reports it
    return None

"""The tracer as its pieces see it.

:class:`~.core.SchedlangTracer` imports the pieces of the tracer (leaf policy, the patches applied while
tracing, the traced module builder); those pieces in turn need to recognise a proxy of this tracer
(a proxy of any other ``fx.Tracer`` passes through them untouched) and call back into it. They do
that through this base class, which sits below all of them, so no piece imports ``core``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch.fx as fx

__all__ = ["TracerBase"]


class TracerBase(fx.Tracer):
    """What the tracer's pieces call: ``SchedlangTracer`` implements every method here."""

    #: the example value of each node traced so far
    metas: Dict[fx.Node, Any]
    #: values the graph reads as attributes (``get_attr`` targets), and the traced child modules by name
    constants: Dict[str, Any]
    children: Dict[str, Tuple[Any, Any]]

    def len_of(self, obj: fx.Proxy) -> int:
        """``len()`` of a traced value, from its example value."""
        raise NotImplementedError

    def record_leaf_call(self, fn: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
        """Record a call of the leaf function ``fn`` as one node; returns its proxy."""
        raise NotImplementedError

"""``overlap_communication(hoist=True)``: forward collectives of a traced module run asynchronously.

Every forward collective of the traced graph (sync points from ``sch.sync`` in forward
mode, ``torch.distributed`` calls, functional-collective waits) is issued where it was,
or earlier (``hoist``), and waited for just before its result is first used, so the
independent computation in between overlaps the communication (seed post 001, 3.3).
Numerics are unchanged. Returns the report (which collectives, how many nodes overlap).

Example::

    sch["layer"].trace()
    print(sch["layer"].overlap_communication())
"""

from __future__ import annotations

from .base import Param, Primitive, register_primitive
from .horizontal_fuse import require_traced

__all__ = ["OverlapCommunication"]


@register_primitive
class OverlapCommunication(Primitive):
    """Issue the traced module's forward collectives asynchronously and wait just before the
    first use, so independent computation runs meanwhile; returns a report.

    Example::

        sch.trace(flatten=True)
        print(sch.overlap_communication())
    """

    name = "overlap_communication"
    params = (Param("hoist", bool, True, "issue each collective as early as its input allows"),)

    @classmethod
    def validate(cls, sch, hoist=True):
        require_traced(sch, "overlap_communication")
        return {"hoist": hoist}

    @classmethod
    def apply(cls, sch, hoist=True):
        from ..graph.passes.overlap_communication import overlap_communication

        report = overlap_communication(sch.mod, path=sch.path, hoist=hoist, root=sch.root.mod)
        sch.metadata["overlap_communication"] = len(report)
        return report

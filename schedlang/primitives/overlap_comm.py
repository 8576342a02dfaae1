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

from ..errors import ScheduleTypeError
from .base import Primitive, register_primitive
from .horizontal_fuse import require_traced

__all__ = ["OverlapCommunication"]


@register_primitive
class OverlapCommunication(Primitive):
    name = "overlap_communication"

    @classmethod
    def validate(cls, sch, hoist=True):
        require_traced(sch, "overlap_communication")
        if not isinstance(hoist, bool):
            raise ScheduleTypeError(f"{sch.path or '<root>'}: overlap_communication hoist must be True or False, "
                                    f"got {hoist!r}")
        return {"hoist": hoist}

    @classmethod
    def apply(cls, sch, hoist=True):
        from ..graph.passes.overlap_communication import overlap_communication

        report = overlap_communication(sch.mod, path=sch.path, hoist=hoist, root=sch.root.mod)
        sch.metadata["overlap_communication"] = len(report)
        return report

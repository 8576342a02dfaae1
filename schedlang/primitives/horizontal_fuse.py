"""``horizontal_fuse(rules=None, min_group_size=2)``: atomic horizontal fusion on a traced module.

Applies the rules of :mod:`schedlang.graph.passes.horizontal` (parallel linears -> one
GEMM or one batched matmul, layer norms and activations over groups -> one op, split/cat
round trips removed) until nothing changes, and returns the report. The module must
have been traced (``sch.trace()``); its arguments are plain data, so a plan replays.

Example::

    sch["embeddings_head"].trace()
    report = sch["embeddings_head"].horizontal_fuse()
    print(report)
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import fx

from ..errors import NotTracedError, ScheduleValueError
from .base import Param, Primitive, register_primitive

__all__ = ["HorizontalFuse"]


def require_traced(sch, primitive: str) -> fx.GraphModule:
    """``sch.mod`` if it is a traced GraphModule, else a NotTracedError saying what to do."""
    module = sch.mod
    if not isinstance(module, fx.GraphModule):
        where = sch.path or "<root>"
        call = f'sch["{sch.path}"].trace()' if sch.path else "sch.trace()"
        raise NotTracedError(f"{where}: {primitive} needs a traced module, but this is {type(module).__name__}; "
                             f"call {call} first")
    return module


def _valid_rules() -> str:
    from ..graph.passes.horizontal import RULES

    return f"valid rules are {', '.join(RULES)}"


@register_primitive
class HorizontalFuse(Primitive):
    """Apply the atomic horizontal-fusion rules to the traced module until nothing changes;
    returns a report of what was fused.

    Example::

        print(sch["heads"].horizontal_fuse(rules=["linear_same_input"]))
    """

    name = "horizontal_fuse"
    params = (
        Param("rules", Optional[Sequence[str]], None, "rule names to apply (None: all)",
              expects="None or a list of rule names", valid=_valid_rules),
        Param("min_group_size", int, 2, "fewest parallel ops worth fusing", expects="an int >= 2"),
    )

    @classmethod
    def validate(cls, sch, rules=None, min_group_size=2):
        from ..graph.passes.horizontal import resolve_rules

        where = sch.path or "<root>"
        require_traced(sch, "horizontal_fuse")
        if rules is not None:
            resolve_rules(rules, where)
            rules = list(rules)
        if type(min_group_size) is not int or min_group_size < 2:
            raise ScheduleValueError(f"{where}: horizontal_fuse min_group_size must be an int >= 2, got "
                                     f"{min_group_size!r}")
        return {"rules": rules, "min_group_size": min_group_size}

    @classmethod
    def apply(cls, sch, rules=None, min_group_size=2):
        from ..graph.passes.horizontal import horizontal_fuse

        report = horizontal_fuse(sch.mod, rules=rules, min_group_size=min_group_size, path=sch.path)
        sch.metadata.setdefault("horizontal_fuse", []).append(dict(report.counts))
        return report

"""``Schedule.trace_until``: trace a model down to given levels, Slapo's way.

The modules at the given paths and everything above them become FX graphs; the children of
those paths stay ``call_module`` nodes (a ``ModuleList`` / ``ModuleDict`` child is not called
itself, so its items stay calls). A module on the way that the tracer cannot handle (Python
control flow on a tensor, say) is kept whole as a call too, and that is logged: the levels
below it were only wanted to be reachable, not traced, so a whole module is still a usable
pipeline cut point or ``replace`` target. A failure of the schedule's own module is an error.

The result is one ``trace`` step whose ``leaf_modules`` lists every kept child, so the plan
replays to the same graphs.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Sequence, Union

import torch.fx as fx
from torch import nn

from .errors import ScheduleTypeError, TraceError

__all__ = ["trace_until", "SLAPO_TRACERS"]

logger = logging.getLogger("schedlang.trace_until")

#: Slapo's tracer names: schedlang's tracer with torch.fx's input rule (see :mod:`schedlang.primitives.trace`)
SLAPO_TRACERS = ("pytorch", "huggingface")
_OPTIONS = ("leaf_modules", "concrete_args", "tracer")
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _children_as_calls(sch, path: str) -> List[str]:
    """The paths (relative to ``sch``) of the children of ``sch[path]`` that stay calls."""
    calls = []
    for name, child in sch[path].child.items():
        child_path = _join(path, name)
        if isinstance(child.mod, _CONTAINERS):
            calls.extend(_join(child_path, item) for item in child.child)
        else:
            calls.append(child_path)
    return calls


def _failing_module(error: TraceError) -> Optional[str]:
    """The full path of the module whose tracing raised ``error``: the innermost tracer on the traceback
    (each traced module has its own), or a deeper module the message starts with (an error about a
    child, raised by its parent's tracer)."""
    from .graph.tracer import SchedlangTracer

    found = None
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, SchedlangTracer):
            found = owner.path
        tb = tb.tb_next
    if found is None:
        return None
    location = str(error).split(": ", 1)[0]
    if location != "<root>" and (not found or location.startswith(found + ".")):
        return location
    return found


def trace_until(sch, paths: Union[str, Sequence[str]], **kwargs: Any) -> None:
    """See :meth:`schedlang.Schedule.trace_until`."""
    where = sch.path or "<root>"
    if isinstance(sch.mod, fx.GraphModule):
        raise TraceError(f"{where}: trace_until traces a module not traced yet, but this one is traced already "
                         f"({type(sch.mod).__name__}); call trace_until before trace on this schedule")
    if isinstance(paths, str):
        paths = [paths]
    elif not (isinstance(paths, (list, tuple)) and paths and all(isinstance(p, str) for p in paths)):
        raise ScheduleTypeError(f"{where}: trace_until expects a submodule path or a non-empty list of paths "
                                f"(strings relative to this schedule), got {paths!r}")
    unknown = sorted(set(kwargs) - set(_OPTIONS) - {"config"})
    if unknown:
        raise ScheduleTypeError(f"{where}: trace_until got unknown options {', '.join(unknown)}; valid options "
                                "are leaf_modules, concrete_args, tracer")
    leaves: list = []
    for path in paths:
        leaves.extend(_children_as_calls(sch, path))
    extra = kwargs.get("leaf_modules")
    if extra is not None:
        leaves.extend([extra] if isinstance(extra, (str, type)) else list(extra))
    tracer = kwargs.get("tracer", "fx")
    options = {"config": kwargs["config"]} if kwargs.get("config") is not None else {}
    kept: List[str] = []
    while True:
        try:
            sch.trace(recursive=True, flatten=False, leaf_modules=(leaves + kept) or None, tracer=tracer,
                      concrete_args=kwargs.get("concrete_args"), **options)
            return
        except TraceError as e:
            failing = _failing_module(e)
            prefix = sch.path + "." if sch.path else ""
            if failing is None or failing == sch.path or not failing.startswith(prefix):
                raise
            relative = failing[len(prefix):]
            if relative in kept or relative in leaves:
                raise
            logger.info("%s: trace_until keeps %s whole (a call in its parent's graph): it cannot be traced: %s",
                        where, failing, e)
            kept.append(relative)

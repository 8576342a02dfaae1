"""Which framework runs what: a registry of *dialects* by kind and target.

Kinds: ``pipeline_stage`` (wraps one stage module for an engine), ``pipeline_engine`` (runs the
stages), ``runtime_engine`` (wraps a built model, e.g. DeepSpeed's engine) and ``log_parser``
(reads a framework's training log for the tuner). A target is a framework name such as
``"deepspeed"``; ``None`` is schedlang's own runtime.

Example::

    @register_framework_dialect("myengine", "runtime_engine")
    def init_my_engine(model, **kwargs):
        return wrapped_model, optimizer
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from ..errors import SchedlangError, ScheduleKeyError, ScheduleValueError

__all__ = ["register_framework_dialect", "get_all_dialects", "get_dialect_cls", "DIALECTS",
           "FrameworkUnavailableError"]


class FrameworkUnavailableError(SchedlangError, ImportError):
    """The framework a build target names is not installed."""


def _plain_runtime(model, **kwargs):
    return model, None


DIALECTS: Dict[str, Dict[Optional[str], Any]] = {
    "pipeline_stage": {},
    "pipeline_engine": {},
    "runtime_engine": {None: _plain_runtime},
    "log_parser": {},
}


def _check_kind(cls_type: str) -> None:
    if cls_type not in DIALECTS:
        raise ScheduleKeyError(f"framework_dialect: kind {cls_type!r} does not exist: valid are {', '.join(DIALECTS)}")


def register_framework_dialect(target: Optional[str], cls_type: str) -> Callable[[Any], Any]:
    """Decorator registering a class or function as the ``cls_type`` dialect of ``target``."""
    _check_kind(cls_type)

    def decorator(dialect):
        if target in DIALECTS[cls_type]:
            existing = DIALECTS[cls_type][target]
            raise ScheduleValueError(f"framework_dialect: target {target!r} already has a {cls_type} dialect "
                                     f"({getattr(existing, '__name__', existing)}); register one dialect of each "
                                     "kind per target")
        DIALECTS[cls_type][target] = dialect
        return dialect

    return decorator


def get_all_dialects(cls_type: str) -> Dict[Optional[str], Any]:
    """Every registered dialect of kind ``cls_type``, by target."""
    _check_kind(cls_type)
    return DIALECTS[cls_type]


def get_dialect_cls(cls_type: str, target: Optional[str], allow_none: bool = False):
    """The ``cls_type`` dialect of ``target``; with ``allow_none``, schedlang's own (target None)
    when ``target`` has none."""
    _check_kind(cls_type)
    table = DIALECTS[cls_type]
    if target in table:
        return table[target]
    if allow_none and None in table:
        return table[None]
    known = ", ".join(repr(t) for t in table) or "none"
    raise ScheduleKeyError(f"framework_dialect: no {cls_type} dialect for target {target!r}: registered targets are {known}")

"""Model schedules by name: ``register_schedule`` (keyed by the module's file name, ``"gpt2"``,
``"opt"`` ...) and ``get_schedule``."""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Callable, Dict, Optional

from ..errors import ScheduleKeyError, ScheduleValueError

__all__ = ["register_schedule", "get_schedule", "SCHEDULE_METHODS"]

SCHEDULE_METHODS: Dict[str, Callable] = {}


def register_schedule(name: Optional[str] = None):
    """Decorator: register ``fn(model, **sch_config) -> Schedule`` under ``name`` (default: the
    defining file's name, e.g. ``gpt_neo``)."""

    def decorator(fn: Callable) -> Callable:
        key = name or os.path.splitext(os.path.basename(inspect.getfile(fn)))[0]
        if key in SCHEDULE_METHODS and SCHEDULE_METHODS[key] is not fn:
            raise ScheduleValueError(f"model_schedule: a model schedule named {key!r} is already registered")
        SCHEDULE_METHODS[key] = fn
        return fn

    return decorator


#: the schedule modules, one per family
FAMILIES = ("gpt2", "gpt_neo", "opt", "llama", "bert", "roberta", "albert", "t5")


def _load_all() -> None:
    """Import every family's schedule module, which registers its schedule."""
    for name in FAMILIES:
        importlib.import_module(f".{name}", __package__)


def get_schedule(model_name: str) -> Callable:
    """The schedule registered as ``model_name``."""
    _load_all()
    if model_name not in SCHEDULE_METHODS:
        raise ScheduleKeyError(f"model_schedule: no model schedule named {model_name!r}: valid are "
                               f"{', '.join(sorted(SCHEDULE_METHODS))}")
    return SCHEDULE_METHODS[model_name]

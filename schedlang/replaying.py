"""Replay a plan on a fresh instance of the model it was made for.

:func:`replay` reads the plan (safely: see :meth:`schedlang.Plan.from_json`), checks that
the model has the structure the plan was made for, wraps the model in a new schedule and
applies every step, all or nothing. It is the layer above the schedule and the plan: it
imports both; neither imports it.

The module is called ``replaying`` so that ``schedlang.replay`` stays the function.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any, Dict, Union

from torch import nn

from .errors import ArgumentTypeError, ScheduleTypeError
from .plan import Plan, apply_steps
from .schedule import Schedule, create_schedule

__all__ = ["replay", "apply_steps"]


def _module_names(trusted_modules: Iterable[Any]) -> tuple:
    if isinstance(trusted_modules, (str, types.ModuleType)):
        trusted_modules = [trusted_modules]
    if not isinstance(trusted_modules, Iterable):
        raise ArgumentTypeError(f"replay: trusted_modules must be a list of module names such as "
                                f"['my_package.layers'] (or modules), got {type(trusted_modules).__name__}")
    names = []
    for m in trusted_modules:
        if isinstance(m, types.ModuleType):
            names.append(m.__name__)
        elif isinstance(m, str) and all(part.isidentifier() for part in m.split(".")):
            names.append(m)
        else:
            raise ScheduleTypeError(f"replay: trusted_modules lists module names such as 'my_package.layers' (or "
                                    f"modules), got {m!r}")
    return tuple(names)


def replay(json_or_plan: Union[str, Dict[str, Any], Plan], model: nn.Module, group=None, mesh=None, *,
           trusted_modules: Iterable[Any] = (), check_fingerprint: bool = True) -> Schedule:
    """Apply a plan to a fresh instance of the model it was made for; returns the new schedule.

    ``group`` / ``mesh`` are as in :func:`schedlang.create_schedule`. ``trusted_modules``
    names modules (or packages) a plan's class names may be imported from; other class
    names must come from modules already imported. A plan records the structure of its model
    (module paths, classes, parameter shapes): on a model that differs,
    :class:`~schedlang.errors.PlanMismatchError` names the first difference, unless
    ``check_fingerprint=False``. The model you pass is never changed; if a step fails, the
    error names it and nothing is applied.

    Example::

        text = sch.plan.to_json()
        sch2 = schedlang.replay(text, MyModel())                     # same steps, same result
        sch3 = schedlang.replay(text, MyModel(), trusted_modules=["my_package.layers"])
    """
    trusted = _module_names(trusted_modules)
    plan = json_or_plan if isinstance(json_or_plan, Plan) else Plan.from_json(json_or_plan, trusted_modules=trusted)
    if not isinstance(model, nn.Module):
        raise ScheduleTypeError(f"replay: expects a torch.nn.Module to apply the plan to, got {type(model).__name__}")
    if check_fingerprint and plan.fingerprint is not None:
        plan.fingerprint.check(model)
    sch = create_schedule(model, group=group, mesh=mesh)
    apply_steps(sch, plan)
    return sch

"""The primitive registry.

A primitive is one kind of schedule step (``shard``, ``sync``, ``trace`` ...). Each
lives in its own file as a subclass of :class:`Primitive` decorated with
:func:`register_primitive`. A primitive says

* how its arguments are checked (:meth:`Primitive.validate`), before anything changes;
* how it changes the schedule's working module (:meth:`Primitive.apply`);
* how its arguments are written to and read from JSON (:meth:`Primitive.encode_args`,
  :meth:`Primitive.decode_args`), so that a plan can be saved and replayed.

:class:`schedlang.Schedule` exposes every registered primitive as a typed method that
calls :meth:`Schedule._run`; a test checks the two lists agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Type

from ..errors import PlanSerializationError, ScheduleKeyError

if TYPE_CHECKING:  # pragma: no cover
    from ..schedule import Schedule

__all__ = ["Primitive", "register_primitive", "get_primitive", "list_primitives", "encode_value"]

_REGISTRY: Dict[str, Type["Primitive"]] = {}


class Primitive:
    """One kind of schedule step. Subclasses are never instantiated; all methods are classmethods."""

    #: the name users call it by (``sch.<name>(...)``) and that plans record
    name: ClassVar[str] = ""
    #: whether a call is recorded as a step of the plan (False for queries such as ``find``)
    records_step: ClassVar[bool] = True

    @classmethod
    def validate(cls, sch: "Schedule", **kwargs: Any) -> Dict[str, Any]:
        """Check the arguments against ``sch`` and return them normalized.

        Must raise a :class:`schedlang.SchedlangError` subclass on bad input and must not
        change anything.
        """
        return dict(kwargs)

    @classmethod
    def apply(cls, sch: "Schedule", **args: Any) -> Any:
        """Change ``sch``'s working module as the step says; return what the method returns."""
        raise NotImplementedError(cls.name)

    @classmethod
    def encode_args(cls, args: Dict[str, Any], step_index: int, path: str) -> Dict[str, Any]:
        """Arguments as JSON-compatible values. The default handles plain data only."""
        return {k: encode_value(v, f"step {step_index} ({cls.name} at '{path or '<root>'}'), argument '{k}'")
                for k, v in args.items()}

    @classmethod
    def decode_args(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        """Inverse of :meth:`encode_args`."""
        return dict(data)

    @classmethod
    def replay_args(cls, args: Dict[str, Any]) -> Dict[str, Any]:
        """Arguments to use when the step is replayed on a fresh model in this process.

        The default reuses them as they are. A primitive whose arguments point into the
        working copy (graph nodes, say) re-encodes them here so they are looked up again.
        """
        return dict(args)

    @classmethod
    def describe_args(cls, args: Dict[str, Any]) -> str:
        """Short human-readable form of the arguments for ``str(plan)``."""
        return ", ".join(f"{k}={_short_repr(v)}" for k, v in args.items())


def _short_repr(value: Any, limit: int = 60) -> str:
    from torch import nn

    if isinstance(value, nn.Module):
        text = f"<{type(value).__name__}>"
    elif isinstance(value, type):
        text = value.__name__
    elif callable(value) and hasattr(value, "__qualname__"):
        text = f"<{getattr(value, '__module__', '?')}.{value.__qualname__}>"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def encode_value(value: Any, where: str) -> Any:
    """Return ``value`` as JSON data, or raise PlanSerializationError saying what cannot be written."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [encode_value(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: encode_value(v, where) for k, v in value.items()}
    raise PlanSerializationError(
        f"{where} is a Python object ({type(value).__name__}: {_short_repr(value)}) and cannot be "
        "serialized to JSON; replay such a plan in the same process with schedlang.replay(plan, model), "
        "or pass plain values (numbers, strings, lists)"
    )


def register_primitive(cls: Type[Primitive]) -> Type[Primitive]:
    """Class decorator: make ``cls`` callable as ``Schedule.<cls.name>`` and replayable."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no primitive name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"primitive '{cls.name}' is registered twice ({_REGISTRY[cls.name].__qualname__}, {cls.__qualname__})")
    _REGISTRY[cls.name] = cls
    return cls


def get_primitive(name: str) -> Type[Primitive]:
    """The primitive class registered as ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ScheduleKeyError(
            f"unknown primitive '{name}': registered primitives are {', '.join(sorted(_REGISTRY))}"
        ) from None


def list_primitives() -> List[str]:
    """Names of all registered primitives, sorted."""
    return sorted(_REGISTRY)

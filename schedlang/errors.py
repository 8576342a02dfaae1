"""The exceptions schedlang raises.

Every error a user can cause derives from :class:`SchedlangError` and from the
builtin exception a Python programmer would expect (``KeyError`` for an unknown
path, ``ValueError`` for a bad argument, ...), so both ``except
schedlang.SchedlangError`` and ``except ValueError`` work.

Messages name the schedule path, the offending value and what would be valid::

    layers.0.linear1: cannot shard 'weight' (shape (128, 32)) along axis 5: valid axes are 0, 1
"""

from __future__ import annotations

__all__ = [
    "SchedlangError",
    "ScheduleKeyError",
    "ScheduleValueError",
    "ScheduleTypeError",
    "ArgumentTypeError",
    "ShardError",
    "SyncError",
    "UnsupportedModelError",
    "PlanError",
    "PlanSerializationError",
    "PlanMismatchError",
    "TraceError",
    "NotTracedError",
    "PatternError",
    "LoweringError",
    "VerificationError",
    "DistributedError",
    "CheckpointError",
    "PipelineError",
    "MissingDependencyError",
]


class SchedlangError(Exception):
    """Base class of every error schedlang raises on bad input or a failed check."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class ScheduleKeyError(SchedlangError, KeyError):
    """A schedule path, tensor name or primitive name does not exist."""


class ScheduleValueError(SchedlangError, ValueError):
    """An argument of a primitive has an invalid value."""


class ScheduleTypeError(SchedlangError, TypeError):
    """An argument of a primitive has the wrong type."""


class ArgumentTypeError(ScheduleTypeError, ScheduleValueError):
    """An argument of a primitive is not of its declared type.

    Both a ``TypeError`` and a ``ValueError``: some primitives reported a wrong type as a bad
    value before their arguments were declared, and ``except ValueError`` keeps working.
    """


class ShardError(ScheduleValueError):
    """A tensor cannot be sharded as asked (axis, divisibility, module type)."""


class SyncError(ScheduleValueError):
    """A synchronization point is invalid (mode, op, axis)."""


class UnsupportedModelError(ScheduleTypeError):
    """A primitive cannot treat a part of the model correctly (``shard_model``, ``context_parallel``);
    raised before any step is written."""


class PlanError(SchedlangError, ValueError):
    """A plan cannot be replayed on the given model."""


class PlanSerializationError(PlanError, TypeError):
    """A step holds a Python object that cannot be written to JSON, or a plan's JSON is malformed
    (missing key, wrong type, unknown primitive or version, a type name from a module not trusted)."""


class PlanMismatchError(PlanError):
    """A plan is replayed on a model whose structure differs from the one it was made for."""


class TraceError(SchedlangError, RuntimeError):
    """A submodule could not be traced into an FX graph."""


class NotTracedError(SchedlangError, RuntimeError):
    """A graph primitive was called on a module that has not been traced."""


class PatternError(ScheduleValueError):
    """A pattern for ``find`` is malformed or matches nothing usable."""


class LoweringError(SchedlangError, NotImplementedError):
    """A subgraph contains operations that a fusion compiler cannot lower."""


class VerificationError(SchedlangError, AssertionError):
    """The scheduled module does not compute what the original module computes."""


class DistributedError(SchedlangError, RuntimeError):
    """A distributed run failed or timed out on some rank."""


class CheckpointError(SchedlangError, ValueError):
    """A checkpoint is missing or does not fit the model (names, shapes), or an export cannot be written."""


class PipelineError(SchedlangError, ValueError):
    """A model cannot be split into pipeline stages as asked, or the stages cannot be run as configured."""


class MissingDependencyError(SchedlangError, ImportError):
    """An optional package a feature needs is not installed; the message names the extra that installs it."""

"""The staged plan: every primitive call, in order, readable and serializable.

``str(sch.plan)`` prints one line per step::

    Plan (3 steps)
      [0] shard       linear1  tensor_name='weight', axis=0
      [1] shard       linear1  tensor_name='bias', axis=0
      [2] sync        linear2  mode='fwd_post', sync_op_or_fn='all_reduce'

``plan.to_json()`` writes it as JSON, with a fingerprint of the model it was made for (see
:mod:`schedlang.fingerprint`); :meth:`Plan.from_json` reads it back, checking every key and
type and resolving class names only from modules already imported or trusted by the
caller. :func:`apply_steps` runs a plan's steps on a schedule, all or nothing;
:func:`schedlang.replay` (in :mod:`schedlang.replaying`) applies a plan to a fresh model.

This module imports only the primitive registry: the schedule imports it, not the reverse.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Iterable, Iterator, List, Optional, Union

from .errors import PlanSerializationError, SchedlangError
from .fingerprint import ModelFingerprint
from .primitives.base import get_primitive
from .primitives.params import DecodeContext

__all__ = ["Step", "Plan", "apply_steps", "PLAN_FORMAT_VERSION"]

PLAN_FORMAT_VERSION = 1


@dataclasses.dataclass
class Step:
    """One primitive call: which primitive, at which path, with which (normalized) arguments."""

    primitive: str
    path: str
    args: Dict[str, Any]

    def describe(self) -> str:
        return get_primitive(self.primitive).describe_args(self.args)


class Plan:
    """Ordered list of :class:`Step`. Shared by every view of one schedule.

    ``fingerprint`` is the structure of the model the plan was made for (None for plans
    written before fingerprints were recorded).
    """

    def __init__(self, steps: Optional[List[Step]] = None, fingerprint: Optional[ModelFingerprint] = None):
        self._steps: List[Step] = list(steps or [])
        self.fingerprint = fingerprint

    def append(self, step: Step) -> None:
        self._steps.append(step)

    def _truncate(self, length: int) -> None:
        """Drop the steps from ``length`` on (used to undo a failed atomic block)."""
        del self._steps[length:]

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[Step]:
        return iter(self._steps)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return Plan(self._steps[index], self.fingerprint)
        return self._steps[index]

    @property
    def steps(self) -> List[Step]:
        return list(self._steps)

    def __str__(self) -> str:
        lines = [f"Plan ({len(self)} step{'s' if len(self) != 1 else ''})"]
        width_p = max([len(s.primitive) for s in self._steps] + [4])
        width_path = max([len(s.path or "<root>") for s in self._steps] + [4])
        for i, s in enumerate(self._steps):
            lines.append(f"  [{i}] {s.primitive:<{width_p}}  {s.path or '<root>':<{width_path}}  {s.describe()}")
        return "\n".join(lines)

    __repr__ = __str__

    def to_dict(self) -> Dict[str, Any]:
        """The plan as JSON-compatible data; raises PlanSerializationError for Python-object arguments."""
        steps = []
        for i, s in enumerate(self._steps):
            prim = get_primitive(s.primitive)
            steps.append({"primitive": s.primitive, "path": s.path, "args": prim.encode_args(s.args, i, s.path)})
        data: Dict[str, Any] = {"format": "schedlang-plan", "version": PLAN_FORMAT_VERSION, "steps": steps}
        if self.fingerprint is not None:
            data["model"] = self.fingerprint.to_dict()
        return data

    def to_json(self, indent: int = 2) -> str:
        """The plan as a JSON string (see :func:`schedlang.replay`)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text_or_data: Union[str, Dict[str, Any]], trusted_modules: Iterable[str] = ()) -> "Plan":
        """Read a plan written by :meth:`to_json`.

        Class names in the plan (``replace_all``'s ``module_type``, ``trace``'s ``leaf_modules``)
        are looked up in modules already imported, or imported from ``trusted_modules`` (names
        of modules or packages); nothing else is ever imported. Any problem with the file is a
        :class:`~schedlang.PlanSerializationError` saying where it is.
        """
        trusted = tuple(trusted_modules)
        try:
            data = json.loads(text_or_data) if isinstance(text_or_data, (str, bytes)) else text_or_data
        except json.JSONDecodeError as e:
            raise PlanSerializationError(f"plan: not a schedlang plan: invalid JSON ({e})") from e
        if not isinstance(data, dict) or data.get("format") != "schedlang-plan":
            raise PlanSerializationError(
                "plan: not a schedlang plan: expected a JSON object with \"format\": \"schedlang-plan\"")
        if "version" not in data:
            raise PlanSerializationError(f"plan: the plan has no \"version\"; this schedlang reads version "
                                         f"{PLAN_FORMAT_VERSION}; add \"version\": {PLAN_FORMAT_VERSION} to the plan")
        if data["version"] != PLAN_FORMAT_VERSION or isinstance(data["version"], bool):
            raise PlanSerializationError(f"plan: format version {data['version']!r} is not supported; this schedlang "
                                         f"reads version {PLAN_FORMAT_VERSION}")
        if "steps" not in data:
            raise PlanSerializationError("plan: the plan has no \"steps\": expected a list of step objects")
        if not isinstance(data["steps"], list):
            raise PlanSerializationError(f"plan: the plan's \"steps\" must be a list of step objects, got "
                                         f"{type(data['steps']).__name__}")
        fingerprint = ModelFingerprint.from_dict(data["model"]) if data.get("model") is not None else None
        return cls([_read_step(i, raw, trusted) for i, raw in enumerate(data["steps"])], fingerprint)


def _read_step(i: int, raw: Any, trusted) -> Step:
    if not isinstance(raw, dict):
        raise PlanSerializationError(f"plan: step {i} of the plan must be a JSON object with \"primitive\", \"path\" and "
                                     f"\"args\", got {raw!r}")
    if "primitive" not in raw:
        raise PlanSerializationError(f"plan: step {i} of the plan is malformed: missing key \"primitive\"; "
                                     "every step must name its primitive")
    name = raw["primitive"]
    try:
        prim = get_primitive(name)
    except SchedlangError as e:
        raise PlanSerializationError(f"plan: step {i} of the plan is malformed or names an unknown primitive: {e}") from None
    path = raw.get("path", "")
    if not isinstance(path, str):
        raise PlanSerializationError(f"step {i} ({name}): \"path\" must be a dotted module path (a string), got "
                                     f"{path!r}")
    unknown = sorted(set(raw) - {"primitive", "path", "args"})
    if unknown:
        raise PlanSerializationError(f"step {i} ({name} at '{path or '<root>'}'): unknown key(s) "
                                     f"{', '.join(map(repr, unknown))}; a step has \"primitive\", \"path\", \"args\"")
    args = prim.decode_args(raw.get("args", {}), DecodeContext(i, name, path, trusted_modules=trusted))
    return Step(name, path, args)


def apply_steps(sch, plan: Plan) -> None:
    """Run every step of ``plan`` on ``sch`` (paths are taken from the root of ``sch``), all or nothing:
    if step k fails, the steps before it are undone and the schedule is as it was.

    ``sch`` is a :class:`schedlang.Schedule`; this module does not import it.
    """
    with sch.atomic():
        for i, step in enumerate(plan):
            prim = get_primitive(step.primitive)
            try:
                target = sch.root[step.path]
                target._run(step.primitive, **prim.replay_args(step.args))
            except SchedlangError as e:
                raise type(e)(f"replaying step {i} ({step.primitive} at '{step.path or '<root>'}'): {e}") from e

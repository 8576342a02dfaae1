"""The staged plan: every primitive call, in order, readable and replayable.

``str(sch.plan)`` prints one line per step::

    Plan (3 steps)
      [0] shard       linear1  tensor_name='weight', axis=0
      [1] shard       linear1  tensor_name='bias', axis=0
      [2] sync        linear2  mode='fwd_post', sync_op_or_fn='all_reduce'

``plan.to_json()`` writes it as JSON and :func:`replay` applies a plan (or its JSON) to a
fresh instance of the same model, e.g. on every rank, or on a meta-device model so that
each rank materializes only its own shards.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Union

from .errors import PlanError, SchedlangError

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from .schedule import Schedule

__all__ = ["Step", "Plan", "replay", "apply_steps", "PLAN_FORMAT_VERSION"]

PLAN_FORMAT_VERSION = 1


@dataclasses.dataclass
class Step:
    """One primitive call: which primitive, at which path, with which (normalized) arguments."""

    primitive: str
    path: str
    args: Dict[str, Any]

    def describe(self) -> str:
        from .primitives.base import get_primitive

        return get_primitive(self.primitive).describe_args(self.args)


class Plan:
    """Ordered list of :class:`Step`. Shared by every view of one schedule."""

    def __init__(self, steps: List[Step] = None):
        self._steps: List[Step] = list(steps or [])

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
            return Plan(self._steps[index])
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
        from .primitives.base import get_primitive

        steps = []
        for i, s in enumerate(self._steps):
            prim = get_primitive(s.primitive)
            steps.append({"primitive": s.primitive, "path": s.path, "args": prim.encode_args(s.args, i, s.path)})
        return {"format": "schedlang-plan", "version": PLAN_FORMAT_VERSION, "steps": steps}

    def to_json(self, indent: int = 2) -> str:
        """The plan as a JSON string (see :func:`replay`)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text_or_data: Union[str, Dict[str, Any]]) -> "Plan":
        """Read a plan written by :meth:`to_json`."""
        from .primitives.base import get_primitive

        try:
            data = json.loads(text_or_data) if isinstance(text_or_data, str) else text_or_data
        except json.JSONDecodeError as e:
            raise PlanError(f"not a schedlang plan: invalid JSON ({e})") from e
        if not isinstance(data, dict) or data.get("format") != "schedlang-plan":
            raise PlanError("not a schedlang plan: expected a JSON object with \"format\": \"schedlang-plan\"")
        if data.get("version") != PLAN_FORMAT_VERSION:
            raise PlanError(f"plan format version {data.get('version')!r} is not supported; this schedlang reads "
                            f"version {PLAN_FORMAT_VERSION}")
        steps = []
        for i, raw in enumerate(data.get("steps", [])):
            try:
                prim = get_primitive(raw["primitive"])
                steps.append(Step(raw["primitive"], raw.get("path", ""), prim.decode_args(dict(raw.get("args", {})))))
            except KeyError as e:
                raise PlanError(f"step {i} of the plan is malformed or names an unknown primitive: {e}") from e
        return cls(steps)


def replay(json_or_plan: Union[str, Dict[str, Any], Plan], model: "nn.Module", group=None, mesh=None) -> "Schedule":
    """Apply a plan to a fresh instance of the model it was made for; returns the new schedule.

    ``group`` / ``mesh`` are as in :func:`schedlang.create_schedule`.

    Example::

        text = sch.plan.to_json()
        sch2 = schedlang.replay(text, MyModel())   # same steps, same result
    """
    from .primitives.base import get_primitive
    from .schedule import create_schedule

    plan = json_or_plan if isinstance(json_or_plan, Plan) else Plan.from_json(json_or_plan)
    sch = create_schedule(model, group=group, mesh=mesh)
    apply_steps(sch, plan)
    return sch


def apply_steps(sch: "Schedule", plan: Plan) -> None:
    """Run every step of ``plan`` on ``sch`` (paths are taken from the root of ``sch``)."""
    from .primitives.base import get_primitive

    for i, step in enumerate(plan):
        prim = get_primitive(step.primitive)
        try:
            target = sch.root[step.path]
            target._run(step.primitive, **prim.replay_args(step.args))
        except SchedlangError as e:
            raise type(e)(f"replaying step {i} ({step.primitive} at '{step.path or '<root>'}'): {e}") from e

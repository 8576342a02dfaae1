"""Ranks that agree: a failure on one rank becomes an error on every rank, within seconds.

A collective blocks until every rank of its group joins it. When one rank raises while the
others wait in (or are on their way to) a collective, those others stay blocked until the
group's timeout and the error that caused it is only in the failed rank's log. Likewise a rank
that applied a different plan runs different collectives and the mismatch goes unnoticed.

This module closes such phases with a vote. Each rank posts a small status (did it finish, and
if not, which exception) to the job's key-value store, the one ``init_process_group`` set up,
and reads everyone else's, so the vote needs no collective and cannot be confused with one::

    with agreement(group, phase="build: tensor-parallel wrapping"):
        distribute_parameters(model, mesh)          # may raise on one rank only

On leaving the block every rank of ``group`` knows what every other rank did:

* all ranks finished: nothing happens;
* every rank raised: each re-raises its own exception (a deterministic error, e.g. a bad
  argument, reads the same as in one process);
* some ranks raised: every rank raises :class:`RankFailureError`, naming the failed ranks and
  their exceptions (on a failed rank, chained to its own exception).

A rank that raised waits for the others only ``$SCHEDLANG_AGREE_GRACE`` seconds (default 10):
a rank that has not arrived by then is most likely blocked in a collective the failed rank will
never join. The failed rank then records that it gave up and destroys its process groups, which
makes collectives blocked on it fail at once (gloo closes the connections; NCCL aborts its
communicators, and a peer's kernels are stopped by its own group timeout). Every rank that sees
the record raises :class:`RankFailureError` and destroys its process groups too: after a rank
gave up, the groups are in no state to be trusted. Healthy ranks wait for the others up to the
process-group timeout (:func:`~schedlang.distributed.groups.pg_timeout`) plus that grace.

:func:`check_same_plan` compares plans across ranks (a hash first, then step by step) and
raises :class:`PlanMismatchError` on every rank, naming the first step that differs.

Every rank of the group must pass through the same agreement points in the same order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import re
import time
import traceback
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch.distributed as dist

from ..errors import DistributedError, ScheduleValueError
from . import groups

__all__ = ["RankFailureError", "PlanMismatchError", "agree", "agreement", "exchange", "check_same_plan",
           "plan_fingerprint", "GRACE_ENV", "DEFAULT_GRACE_S"]

logger = logging.getLogger("schedlang.distributed.agreement")

#: environment variable: seconds a rank that failed waits for the others before it gives up on them
GRACE_ENV = "SCHEDLANG_AGREE_GRACE"
DEFAULT_GRACE_S = 10.0
_MESSAGE_LIMIT = 2000

# agreement rounds so far per set of ranks (every rank counts the same rounds, so the keys match)
_rounds: Dict[str, int] = {}
# stores in use: keeps a store (and a server it may host) alive after its process group is destroyed
_stores: List[Any] = []


class RankFailureError(DistributedError):
    """Some ranks of a group failed (or never arrived) during a phase; raised on every rank.

    Attributes: ``phase``; ``failures`` (rank -> ``"ExceptionType: message"``); ``missing`` (ranks
    that never arrived); ``gave_up`` (the rank that stopped waiting for them, or None).
    """

    def __init__(self, message: str, phase: str = "", failures: Optional[Dict[int, str]] = None,
                 missing: Sequence[int] = (), gave_up: Optional[int] = None):
        super().__init__(message)
        self.phase = phase
        self.failures = dict(failures or {})
        self.missing = list(missing)
        self.gave_up = gave_up


class PlanMismatchError(DistributedError):
    """The ranks of a group hold different plans; raised on every rank."""


@dataclasses.dataclass
class _Status:
    rank: int  # in the group
    global_rank: int
    ok: bool
    error: str = ""  # "TypeName: message"
    where: str = ""  # innermost frame of the exception
    payload: Any = None
    own: bool = False  # the error came from this rank, not from a peer that gave up on it


def _grace() -> float:
    raw = os.environ.get(GRACE_ENV, "").strip()
    if not raw:
        return DEFAULT_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        raise ScheduleValueError(f"${GRACE_ENV}={raw!r} is not a number of seconds; set it to a positive number "
                                 f"such as {DEFAULT_GRACE_S:g}") from None
    if not value > 0:
        raise ScheduleValueError(f"${GRACE_ENV} must be a positive number of seconds, got {raw!r}")
    return value


def _group_ranks(group) -> Optional[List[int]]:
    """Global ranks of ``group`` (a process group, a DeviceMesh, None for the world); None when there
    is nothing to agree with (no torch.distributed, or a single rank)."""
    if not groups.is_distributed() or isinstance(group, groups.SingleRankGroup):
        return None
    if dist.get_backend() == "fake":  # torch's fake process group: one rank of a world that is not there
        return None
    if group is None:
        ranks = list(range(dist.get_world_size()))
    elif hasattr(group, "mesh") and hasattr(group, "mesh_dim_names"):  # a DeviceMesh
        ranks = [int(r) for r in group.mesh.flatten().tolist()]
    else:
        ranks = list(dist.get_process_group_ranks(group))
    return ranks if len(ranks) > 1 else None


def _describe(error: BaseException) -> Tuple[str, str]:
    message = str(error)
    if len(message) > _MESSAGE_LIMIT:
        message = message[:_MESSAGE_LIMIT] + " ..."
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    frames = traceback.extract_tb(error.__traceback__)
    # the innermost frame of the user's or schedlang's code says more than one inside torch
    torch_dir = os.path.dirname(os.path.dirname(dist.__file__))
    own = [f for f in frames if not os.path.abspath(f.filename).startswith(torch_dir)] or frames
    where = f"{os.path.basename(own[-1].filename)}:{own[-1].lineno} in {own[-1].name}" if own else ""
    return text, where


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class _Round:
    """One vote of the ranks ``ranks`` over the store."""

    def __init__(self, ranks: List[int], phase: str):
        self.ranks = ranks
        self.world = len(ranks)
        self.me = ranks.index(dist.get_rank())
        self.whole_world = ranks == list(range(dist.get_world_size()))
        self.phase = phase
        self.store = dist.distributed_c10d._get_default_store()
        if not any(s is self.store for s in _stores):
            _stores.append(self.store)
        tag = ",".join(map(str, ranks))
        if len(tag) > 40:
            tag = hashlib.sha1(tag.encode()).hexdigest()[:16]
        number = _rounds.get(tag, 0)
        _rounds[tag] = number + 1
        self.prefix = f"schedlang/agreement/{tag}/{number}"

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _arrived(self) -> int:
        return int(self.store.add(self.key("arrived"), 0))

    def run(self, status: _Status, wait_s: float) -> Tuple[Dict[int, _Status], Optional[dict]]:
        """Post ``status``; return every rank's status and, if some rank gave up waiting, its record."""
        if not status.ok and self.store.check([self.key("gave_up")]):
            status.own = False  # failed because a peer gave up on this rank and closed the groups
        self.store.set(self.key(f"status/{self.me}"), pickle.dumps(status))
        self.store.add(self.key("arrived"), 1)
        deadline = time.monotonic() + wait_s
        pause = 0.001
        gave_up = None
        while True:
            if self.store.check([self.key("gave_up")]):
                gave_up = pickle.loads(self.store.get(self.key("gave_up")))
                break
            if self._arrived() >= self.world:
                # a rank may have given up just before the last one arrived: the record decides
                if self.store.check([self.key("gave_up")]):
                    gave_up = pickle.loads(self.store.get(self.key("gave_up")))
                break
            if time.monotonic() > deadline:
                if self._arrived() >= self.world:
                    break
                missing = self._missing()
                gave_up = {"rank": self.me, "missing": missing, "waited": wait_s}
                if not self.store.check([self.key("gave_up")]):
                    self.store.set(self.key("gave_up"), pickle.dumps(gave_up))
                else:  # another rank gave up at the same moment: one record for all
                    gave_up = pickle.loads(self.store.get(self.key("gave_up")))
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        statuses = {}
        for r in range(self.world):
            if self.store.check([self.key(f"status/{r}")]):
                statuses[r] = pickle.loads(self.store.get(self.key(f"status/{r}")))
        if gave_up is None:
            self._clean_up()
        return statuses, gave_up

    def _missing(self) -> List[int]:
        return [r for r in range(self.world) if not self.store.check([self.key(f"status/{r}")])]

    def _clean_up(self) -> None:
        # the last rank to read the round deletes its keys, so a long job does not grow the store
        if int(self.store.add(self.key("read"), 1)) != self.world:
            return
        try:
            for name in [f"status/{r}" for r in range(self.world)] + ["arrived", "read"]:
                self.store.delete_key(self.key(name))
        except Exception as e:  # a store without deletion keeps a few bytes per round
            logger.debug("could not delete agreement keys: %s", e)


def _tear_down() -> None:
    """Destroy this process's groups, so that no peer stays blocked on a collective with this rank."""
    if not groups.is_distributed():
        return
    try:
        dist.destroy_process_group()
    except Exception as e:  # already half torn down: nothing more to release
        logger.debug("destroying the process groups failed: %s", e)


def _failure_message(phase: str, statuses: Dict[int, _Status], gave_up: Optional[dict], world: int,
                     whole_world: bool) -> str:
    own = {r: s for r, s in sorted(statuses.items()) if not s.ok and s.own}
    followed = {r: s for r, s in sorted(statuses.items()) if not s.ok and not s.own}
    where = f" during '{phase}'" if phase else ""

    def said(s: _Status) -> str:
        return s.error + (f" (at {s.where})" if s.where else "")

    if len(own) == 1:
        (r, s), = own.items()
        lines = [f"rank {r} failed{where}: {said(s)}"]
    elif own:
        lines = [f"{_ranks_text(list(own))} failed{where}:"] + [f"  rank {r}: {said(s)}" for r, s in own.items()]
    else:
        lines = [f"the ranks did not all finish{where}"]
    for r, s in followed.items():
        lines.append(f"  then rank {r} raised {s.error}")
    if gave_up is not None and gave_up.get("missing"):
        lines.append(f"  rank {gave_up['rank']} waited {gave_up['waited']:.0f} s for "
                     f"{_ranks_text(gave_up['missing'])} (blocked in a collective, or slower), then destroyed its "
                     "process groups so that no rank stays blocked")
    if not whole_world:
        lines.append(f"  (ranks are numbered within the group of {world})")
    return "\n".join(lines)


def exchange(payload: Any = None, group=None, phase: str = "", error: Optional[BaseException] = None,
             timeout=None) -> List[Any]:
    """Every rank posts ``payload`` (and ``error`` if it failed); returns the payloads by group rank.

    Raises as described in the module docstring when some rank failed. ``timeout`` (seconds)
    bounds the wait of a healthy rank; the default is the process-group timeout.

    Example::

        hashes = exchange(plan_hash, group, phase="plan comparison")
    """
    ranks = _group_ranks(group)
    if ranks is None:
        if error is not None:
            raise error
        return [payload]
    session = _Round(ranks, phase)
    text, where = _describe(error) if error is not None else ("", "")
    own = error is not None and not isinstance(error, RankFailureError)
    status = _Status(session.me, dist.get_rank(), error is None, text, where, payload if error is None else None,
                     own)
    # a healthy rank outwaits the group timeout, so a peer blocked in a collective reports its own timeout
    wait_s = _grace() if error is not None else groups.pg_timeout(timeout).total_seconds() + _grace()
    statuses, gave_up = session.run(status, wait_s)
    if gave_up is not None:
        _tear_down()
    failed = [r for r, s in statuses.items() if not s.ok]
    if gave_up is None and not failed:
        return [statuses[r].payload for r in range(session.world)]
    message = _failure_message(phase, statuses, gave_up, session.world, session.whole_world)
    if gave_up is None and len(failed) == session.world and error is not None:
        # every rank failed: each reports its own error, as one process would
        if hasattr(error, "add_note") and len(set(statuses[r].error for r in failed)) > 1:
            error.add_note("on the other ranks:\n" + message)
        raise error
    logger.info("%s", message)
    raise RankFailureError(message, phase, {r: statuses[r].error for r in failed},
                           (gave_up or {}).get("missing", []), (gave_up or {}).get("rank")) from error


def agree(ok: bool, error: Optional[BaseException] = None, group=None, phase: str = "", timeout=None) -> None:
    """Close a phase on every rank of ``group``: returns if every rank is ``ok``, raises otherwise.

    Example::

        try:
            step()
        except Exception as e:
            agree(False, e, group, phase="step")
        else:
            agree(True, None, group, phase="step")
    """
    if not ok and error is None:
        error = DistributedError(f"rank {groups.rank(None)} reported a failure during '{phase}'")
    exchange(None, group, phase, None if ok else error, timeout)


@contextlib.contextmanager
def agreement(group=None, phase: str = "", timeout=None) -> Iterator[None]:
    """Run the block, then agree on its outcome with every rank of ``group`` (see the module docstring).

    Example::

        with agreement(group, phase="verify: forward and backward"):
            out = model(x)
    """
    try:
        yield
    except Exception as e:
        agree(False, e, group, phase, timeout)
        raise  # pragma: no cover  (agree always raises on a failure)
    else:
        agree(True, None, group, phase, timeout)


# ---------------------------------------------------------------------------------------------
# plans

def _strip_addresses(text: str) -> str:
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def _plan_steps(plan: Any) -> Optional[List[Tuple[str, str]]]:
    """``[(digest text, description)]`` per step; None for a bare hash."""
    from ..plan import Plan

    if hasattr(plan, "plan") and isinstance(getattr(plan, "plan"), Plan):  # a Schedule
        plan = plan.plan
    if isinstance(plan, Plan):
        from ..primitives.base import get_primitive

        steps = []
        for i, s in enumerate(plan):
            prim = get_primitive(s.primitive)
            try:
                args = json.dumps(prim.encode_args(s.args, i, s.path), sort_keys=True, default=str)
            except Exception:  # Python objects as arguments: their text, without memory addresses
                args = _strip_addresses(s.describe())
            description = _strip_addresses(f"{s.primitive} at '{s.path or '<root>'}' ({s.describe()})")
            steps.append((f"{s.primitive}|{s.path}|{args}", description))
        return steps
    if isinstance(plan, str):
        try:
            plan = json.loads(plan)
        except ValueError:
            return None
    if isinstance(plan, dict) and isinstance(plan.get("steps"), list):
        steps = []
        for s in plan["steps"]:
            args = json.dumps(s.get("args"), sort_keys=True, default=str)
            steps.append((f"{s.get('primitive')}|{s.get('path')}|{args}",
                          f"{s.get('primitive')} at '{s.get('path') or '<root>'}' ({args})"))
        return steps
    raise ScheduleValueError(f"check_same_plan: expected a Plan, a Schedule, a plan's JSON or a hash string, got "
                             f"{type(plan).__name__}")


def plan_fingerprint(plan: Any) -> str:
    """A hash of a plan's steps (a Plan, a Schedule or a plan's JSON); a string that is not JSON is
    taken as a hash already."""
    steps = _plan_steps(plan)
    if steps is None:
        return str(plan)
    digest = hashlib.sha256()
    for text, _ in steps:
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def check_same_plan(plan: Any, group=None, phase: str = "plan comparison", timeout=None) -> None:
    """Raise :class:`PlanMismatchError` on every rank of ``group`` unless they all hold the same plan.

    Hashes are compared first; when they differ the message names the first step that differs
    between the group's rank 0 and each other rank.

    Example::

        check_same_plan(sch.plan, group)   # before the plan's collectives run
    """
    steps = _plan_steps(plan)
    fingerprint = plan_fingerprint(plan)
    seen = exchange(fingerprint, group, phase, timeout=timeout)
    if len(set(seen)) == 1:
        return
    # the hashes differ: a second round brings the steps themselves, to name the first difference
    described = [] if steps is None else [(hashlib.sha256(t.encode()).hexdigest()[:16], d[:300]) for t, d in steps]
    all_steps = exchange(described, group, phase + " (steps)", timeout=timeout)
    lines = [f"{phase}: the plans differ between ranks (hash {seen[0]} on rank 0)"]
    for r in range(1, len(seen)):
        if seen[r] == seen[0]:
            continue
        ref, other = all_steps[0], all_steps[r]
        first = next((i for i, (a, b) in enumerate(zip(ref, other)) if a[0] != b[0]), None)
        if first is not None:
            lines.append(f"  rank {r} (hash {seen[r]}) first differs at step [{first}]: rank 0 has "
                         f"{ref[first][1]}, rank {r} has {other[first][1]}")
        elif len(ref) != len(other):
            short, long_, longer = (r, 0, ref) if len(other) < len(ref) else (0, r, other)
            lines.append(f"  rank {r} (hash {seen[r]}) has {len(other)} steps, rank 0 {len(ref)}: rank {long_}'s "
                         f"step [{min(len(ref), len(other))}] ({longer[min(len(ref), len(other))][1]}) is missing "
                         f"on rank {short}")
        else:
            lines.append(f"  rank {r} has hash {seen[r]} (its steps were not given, only a hash)")
    lines.append("every rank must apply the same primitives in the same order (e.g. replay one plan's JSON on "
                 "every rank)")
    raise PlanMismatchError("\n".join(lines))

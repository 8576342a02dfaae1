"""Agreement between ranks for checkpoint and pretrained-weight I/O: a problem one rank finds is
raised on every rank, so that none is left waiting in the next collective."""

from __future__ import annotations

from typing import Optional

from ..errors import CheckpointError


class CheckpointDamagedError(CheckpointError):
    """A checkpoint whose files are missing, cut short or cannot be read: a save that was interrupted, or a
    damaged copy. An earlier checkpoint may still load (the trainer falls back to it)."""

#: keys named in an error before "... and N more"
_NAMES_SHOWN = 8


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def _world() -> int:
    dist = _dist()
    return dist.get_world_size() if dist is not None else 1


def _all_gather(obj) -> list:
    """Every rank's ``obj``, by rank (a list of one without torch.distributed)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _agree(problem: Optional[str], damaged: bool = False) -> None:
    """Raise the same :class:`CheckpointError` on every rank if any rank found a problem.

    A rank that raised alone would leave the others waiting in the next collective. ``damaged`` says
    that this rank's problem is damage to the checkpoint (a file missing, cut short or unreadable):
    the error is a :class:`CheckpointDamagedError` when every problem found is, the same on every rank,
    so that all ranks take the same turn (the trainer tries an earlier checkpoint on that error only).
    """
    found = [(r, p, d) for r, (p, d) in enumerate(_all_gather((problem, bool(damaged)))) if p]
    if not found:
        return
    error = CheckpointDamagedError if all(d for _, _, d in found) else CheckpointError
    messages = list(dict.fromkeys(p for _, p, _ in found))
    if len(messages) == 1:
        raise error(messages[0])
    raise error("\n".join(f"rank {r}: {p}" for r, p, _ in found))


def _names(keys) -> str:
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:_NAMES_SHOWN])
    return shown + (f" ... and {len(keys) - _NAMES_SHOWN} more" if len(keys) > _NAMES_SHOWN else "")


def _capped(lines: list, what: str) -> list:
    """The first of ``lines`` (one problem each), then how many more: a model that does not fit at all (another
    config) has a problem per tensor, and an error naming them all would run to hundreds of lines."""
    if len(lines) <= _NAMES_SHOWN:
        return list(lines)
    return list(lines[:_NAMES_SHOWN]) + [f"... and {len(lines) - _NAMES_SHOWN} more {what}"]

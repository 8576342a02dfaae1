"""Asynchronous collectives: start now, wait at the first use, compute in between.

A synchronous collective stops the rank until the data has arrived. Split in two, it is
*issued* where it was (``async_op=True``) and *waited for* just before its result is
first needed; independent work scheduled between the two runs while the data moves
(on GPUs the NCCL kernel runs on its own stream; on CPU gloo works in its own thread).
The ``overlap_communication`` primitive rewrites traced graphs into these calls.

:func:`start_sync` / :func:`wait_sync` are the asynchronous form of a
:class:`~schedlang.distributed.sync_ops.SyncOp` in forward mode, with the same numerics
and the same backward (the adjoints of :mod:`schedlang.distributed.collectives`,
computed synchronously in backward):

==================  ==============================  =====================================
op                  forward (asynchronous)          backward
==================  ==============================  =====================================
all_reduce          all-reduce (sum)                identity
all_gather(axis)    all-gather along axis           this rank's slice (or reduce-scatter)
reduce_scatter      reduce-scatter along axis       all-gather
==================  ==============================  =====================================

Example::

    pending = start_sync(sync_module, partial)   # returns at once
    other = expensive(independent_input)         # overlaps with the all-reduce
    full = wait_sync(pending)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from . import collectives as C
from .groups import world_size as _world_size

__all__ = ["PendingCollective", "start_sync", "wait_sync", "start_collective", "wait_work"]


class PendingCollective:
    """A collective in flight: its ``work`` handle and the buffer it writes into."""

    __slots__ = ("work", "buffer", "kind", "axis", "group", "result")

    def __init__(self, kind: str, axis: Optional[int], group):
        self.kind, self.axis, self.group = kind, axis, group
        self.work: Any = None
        self.buffer: Optional[torch.Tensor] = None
        self.result: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        state = "done" if self.work is None else "in flight"
        return f"PendingCollective({self.kind}, axis={self.axis}, {state})"


def _gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


class _Start(torch.autograd.Function):
    """Issues the collective; returns the buffer it fills (valid after ``wait``)."""

    @staticmethod
    def forward(ctx, x, pending: PendingCollective, replicated: bool):
        kind, axis, group = pending.kind, pending.axis, pending.group
        ctx.kind, ctx.axis, ctx.group, ctx.replicated = kind, axis, group, replicated
        if kind == "reduce_scatter":  # refused on every rank before any collective (gloo's path too)
            C.check_even_split("start_collective", "reduce-scatter", x, axis, _world_size(group))
        if kind == "all_reduce" or (kind == "reduce_scatter" and _gloo(group)):
            # gloo has no reduce-scatter: all-reduce, then keep this rank's slice at the wait
            buffer = x.contiguous().clone()
            pending.work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
        elif kind == "all_gather":
            world = _world_size(group)
            buffer = x.new_empty((world,) + tuple(x.shape))
            pending.work = dist.all_gather(list(buffer.unbind(0)), x.contiguous(), group=group, async_op=True)
        elif kind == "reduce_scatter":
            world = _world_size(group)
            parts = [p.contiguous() for p in x.chunk(world, dim=axis)]
            buffer = torch.empty_like(parts[0])
            pending.work = dist.reduce_scatter(buffer, parts, op=dist.ReduceOp.SUM, group=group, async_op=True)
        else:
            raise ValueError(f"unknown collective {kind!r}")
        return buffer

    @staticmethod
    def backward(ctx, grad):
        kind, axis, group = ctx.kind, ctx.axis, ctx.group
        if kind == "all_reduce":
            return grad, None, None
        if kind == "all_gather":
            # grad is (world, *x.shape): entry r belongs to rank r's input
            if ctx.replicated:
                return grad[dist.get_rank(group)], None, None
            return C.reduce_scatter_tensor(grad, 0, group).squeeze(0), None, None
        if _gloo(group):
            # the buffer was the full all-reduced tensor, of which the wait kept this rank's slice
            return C.all_gather_tensor(C.local_slice(grad, axis, group), axis, group), None, None
        return C.all_gather_tensor(grad, axis, group), None, None


def start_collective(x: torch.Tensor, kind: str, axis: Optional[int] = None, group=None,
                     grad_is_replicated: bool = True) -> PendingCollective:
    """Issue ``kind`` ("all_reduce", "all_gather", "reduce_scatter") on ``x`` and return at once."""
    pending = PendingCollective(kind, axis, group)
    if _world_size(group) == 1:
        pending.result = x
        return pending
    pending.buffer = _Start.apply(x, pending, grad_is_replicated)
    return pending


def wait_sync(pending: PendingCollective) -> torch.Tensor:
    """Wait for a collective started by :func:`start_sync` / :func:`start_collective`; return its result."""
    if pending.result is not None:
        return pending.result
    if pending.work is not None:
        pending.work.wait()
        pending.work = None
    buffer = pending.buffer
    if pending.kind == "all_gather":
        axis = pending.axis % (buffer.dim() - 1)
        result = buffer.movedim(0, axis).flatten(axis, axis + 1)
    elif pending.kind == "reduce_scatter" and _gloo(pending.group):
        result = C.local_slice(buffer, pending.axis, pending.group)
    else:
        result = buffer
    pending.result = result
    pending.buffer = None
    return result


def start_sync(sync, x: torch.Tensor) -> PendingCollective:
    """Asynchronous form of ``sync(x)`` for a forward-mode SyncOp with a named op."""
    # the checks ``sync(x)`` would run first (its forward pre-hooks name the schedule path), so that a bad
    # shape is refused on every rank before any collective is issued
    for check in sync._forward_pre_hooks.values():
        check(sync, (x,))
    return start_collective(x, sync.op, sync.axis, sync.group, getattr(sync, "grad_is_replicated", True))


def wait_work(work) -> None:
    """Wait for the handle of a ``torch.distributed`` call issued with ``async_op=True``."""
    if work is not None:
        work.wait()

"""All-reduces that ``torch.compile`` keeps whole: opaque custom ops inside a compiled layer's graph.

A tensor-parallel layer has all-reduces in its forward (after a row-parallel Linear) and in its
backward (before a column-parallel one). Run eagerly, each one splits the compiled layer into
pieces (a graph break), and every piece costs the host a guard check and its own runtime wrapper,
forward and backward: on a deep model the host, not the GPU, sets the step time. Traced as torch's
functional collectives, they stay in the graph, but torch before 2.13 lost the backward one
(see :func:`schedlang.models.compile_layers`).

Here the all-reduce is one custom operator, ``schedlang::all_reduce_sum``: the compiler sees an
opaque call with a known output shape, keeps it where the data puts it, and calls it at run time,
where it is exactly the eager ``torch.distributed.all_reduce`` of a copy. The two Megatron
conjugates are autograd functions around it (all-reduce forward and identity backward, or the other
way round), so the backward's all-reduce lands in the compiled backward graph the same way. Every
rank compiles the same graph, so every rank issues its collectives in the same order.

The process group travels by name (``ProcessGroup.group_name``), a string the graph can hold.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .collectives import conjugate_reductions

__all__ = ["all_reduce_sum", "group_name", "opaque_reduce_forward", "opaque_reduce_backward"]


def group_name(group: Optional["dist.ProcessGroup"]) -> str:
    """The registered name of ``group`` (the world's for None), which the custom operator resolves back."""
    return (group if group is not None else dist.group.WORLD).group_name


@torch.library.custom_op("schedlang::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: torch.Tensor, group: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks of the process group named ``group``, in a new contiguous tensor."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=_resolve_process_group(group))
    return out


@all_reduce_sum.register_fake
def _all_reduce_sum_shape(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _opaque_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.ops.schedlang.all_reduce_sum(x, group)


_OpaqueReduceForward, _OpaqueReduceBackward = conjugate_reductions(_opaque_all_reduce, prefix="_Opaque")


def opaque_reduce_forward(x: torch.Tensor, group: str) -> torch.Tensor:
    """All-reduce (sum) in forward, identity in backward: :func:`schedlang.distributed.collectives.reduce_forward`
    as one opaque operator for the compiler."""
    return _OpaqueReduceForward.apply(x, group)


def opaque_reduce_backward(x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity in forward, all-reduce (sum) of the gradient in backward: :func:`~schedlang.distributed.collectives.
    reduce_backward` with the backward's all-reduce as one opaque operator for the compiler."""
    return _OpaqueReduceBackward.apply(x, group)

"""Autograd-aware collectives for tensor and sequence parallelism.

Each function here is differentiable: its backward is the collective's adjoint, so
a schedule that inserts it keeps gradients exact. With one rank (or without
torch.distributed) every function is the identity.

==========================  ======================  ===========================
function                    forward                 backward
==========================  ======================  ===========================
``reduce_forward``          all-reduce (sum)        identity
``reduce_backward``         identity                all-reduce (sum)
``gather_forward(axis)``    all-gather along axis   keep this rank's slice
``scatter_forward(axis)``   keep this rank's slice  all-gather along axis
``reduce_scatter_forward``  reduce-scatter          all-gather
==========================  ======================  ===========================

``reduce_forward`` after a row-parallel linear and ``reduce_backward`` before a
column-parallel one are the two conjugate operators of Megatron-LM's MLP.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from ..errors import SyncError
from .groups import rank as _rank
from .groups import world_size as _world_size

__all__ = [
    "reduce_forward",
    "reduce_backward",
    "gather_forward",
    "scatter_forward",
    "reduce_scatter_forward",
    "all_gather_tensor",
    "reduce_scatter_tensor",
    "local_slice",
]


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def all_gather_tensor(x: torch.Tensor, axis: int, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``axis`` (not differentiable)."""
    world = _world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=axis)


def check_even_split(where: str, verb: str, x: torch.Tensor, axis: int, world: int, context: str = "") -> None:
    """Refuse an axis that ``x`` lacks, or a size the ranks cannot share equally.

    Raised before any collective: ``x``'s shape along ``axis`` is the same on every rank at a sync point
    (that is what splitting it evenly needs), so every rank raises here and none waits in a collective.
    ``context`` says which sync point runs this, for a message read far from the schedule that made it.
    """
    if not -x.dim() <= axis < x.dim():
        raise SyncError(f"{where}: cannot {verb} along axis {axis}{context}: the tensor has shape {tuple(x.shape)}, "
                        f"so valid axes are {-x.dim()} to {x.dim() - 1}")
    size = x.shape[axis]
    if size % world:
        nearest = [n for n in (size // world * world, (size // world + 1) * world) if n > 0]
        raise SyncError(f"{where}: cannot {verb} dimension {axis} of size {size} over {world} ranks{context}: the "
                        f"size must be divisible by {world} (e.g. {' or '.join(map(str, nearest))})")


def local_slice(x: torch.Tensor, axis: int, group=None) -> torch.Tensor:
    """This rank's equal slice of ``x`` along ``axis``."""
    world = _world_size(group)
    if world == 1:
        return x
    check_even_split("local_slice", "split", x, axis, world)
    size = x.shape[axis]
    return x.narrow(axis, _rank(group) * (size // world), size // world).contiguous()


def reduce_scatter_tensor(x: torch.Tensor, axis: int, group=None) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's slice along ``axis`` (not differentiable)."""
    world = _world_size(group)
    if world == 1:
        return x
    check_even_split("reduce_scatter_tensor", "reduce-scatter", x, axis, world)
    if dist.get_backend(group) == "gloo":
        # gloo has no reduce-scatter: an all-reduce followed by a slice gives the same values
        return local_slice(_all_reduce(x, group), axis, group)
    parts = [p.contiguous() for p in x.chunk(world, dim=axis)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=group)
    return out


def conjugate_reductions(all_reduce, prefix: str = "") -> tuple:
    """Megatron's two conjugate autograd functions around ``all_reduce(x, group)``: ``(Forward, Backward)``,
    the first summing in forward (identity backward), the second summing the gradient (identity forward).
    Here over eager collectives; :mod:`schedlang.distributed.opaque_collectives` builds the same pair over
    its compiler-opaque operator."""

    def reduce_forward(ctx, x, group):
        return all_reduce(x, group)

    def pass_gradient(ctx, grad):
        return grad, None

    def pass_value(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    def reduce_gradient(ctx, grad):
        return all_reduce(grad, ctx.group), None

    def function(name, forward, backward):
        return type(prefix + name, (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    return (function("ReduceForward", reduce_forward, pass_gradient),
            function("ReduceBackward", pass_value, reduce_gradient))


_ReduceForward, _ReduceBackward = conjugate_reductions(_all_reduce, prefix="_")


class _GatherForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, group, grad_is_replicated):
        ctx.axis, ctx.group, ctx.replicated = axis, group, grad_is_replicated
        return all_gather_tensor(x, axis, group)

    @staticmethod
    def backward(ctx, grad):
        # a replicated downstream computation gives every rank the full gradient: keep our slice;
        # otherwise each rank holds a partial gradient that must be summed first
        if ctx.replicated:
            return local_slice(grad, ctx.axis, ctx.group), None, None, None
        return reduce_scatter_tensor(grad, ctx.axis, ctx.group), None, None, None


def _along_axis(name: str, forward_op, backward_op) -> type:
    """An autograd function ``f(x, axis, group)`` that runs ``forward_op`` forward and
    ``backward_op`` on the gradient, both along ``axis`` over ``group``."""

    def forward(ctx, x, axis, group):
        ctx.axis, ctx.group = axis, group
        return forward_op(x, axis, group)

    def backward(ctx, grad):
        return backward_op(grad, ctx.axis, ctx.group), None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})


# each rank keeps its slice; the gradient slices are gathered back
_ScatterForward = _along_axis("_ScatterForward", local_slice, all_gather_tensor)
# partial sums reduced and scattered; the gradient slices are gathered back
_ReduceScatterForward = _along_axis("_ReduceScatterForward", reduce_scatter_tensor, all_gather_tensor)


def reduce_forward(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) in forward; identity in backward."""
    return x if _world_size(group) == 1 else _ReduceForward.apply(x, group)


def reduce_backward(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity in forward; all-reduce (sum) of the gradient in backward."""
    return x if _world_size(group) == 1 else _ReduceBackward.apply(x, group)


def gather_forward(x: torch.Tensor, axis: int, group=None, grad_is_replicated: bool = True) -> torch.Tensor:
    """All-gather along ``axis`` in forward; slice (or reduce-scatter) the gradient in backward."""
    return x if _world_size(group) == 1 else _GatherForward.apply(x, axis, group, grad_is_replicated)


def scatter_forward(x: torch.Tensor, axis: int, group=None) -> torch.Tensor:
    """Keep this rank's slice along ``axis`` in forward; all-gather the gradient in backward."""
    # named here, where the sync point that splits is known (an all_gather of the gradient, at bwd_post)
    return _split_forward(_ScatterForward, "scatter_forward", "split", x, axis, group,
                          " (the forward half of sync op 'all_gather' at bwd_post)")


def reduce_scatter_forward(x: torch.Tensor, axis: int, group=None) -> torch.Tensor:
    """Reduce-scatter along ``axis`` in forward; all-gather the gradient in backward."""
    return _split_forward(_ReduceScatterForward, "reduce_scatter_forward", "reduce-scatter", x, axis, group,
                          " (sync op 'reduce_scatter' at fwd_pre or fwd_post)")


def _split_forward(function, name: str, verb: str, x: torch.Tensor, axis: int, group, sync_point: str) -> torch.Tensor:
    """``function`` (a collective that leaves each rank one of ``world`` equal parts along ``axis``), after checking
    that ``x`` splits evenly; ``x`` itself on one rank."""
    world = _world_size(group)
    if world == 1:
        return x
    check_even_split(name, verb, x, axis, world, sync_point)
    return function.apply(x, axis, group)

"""Differentiable collectives with Slapo's names and signatures.

==================================  ========================  =====================================
function                            forward                   backward
==================================  ========================  =====================================
``reduce_forward_output(x, g)``     all-reduce (sum)          identity
``reduce_backward_grad(x, g)``      identity                  all-reduce (sum)
``all_gather_forward_output``       all-gather along ``dim``  reduce-scatter (the consumer is
                                                              sharded), or keep this rank's slice
                                                              (``tensor_parallel_output_grad=False``)
``scatter_forward_output``          keep this rank's slice    all-gather
``reduce_scatter_forward_output``   reduce-scatter            all-gather
==================================  ========================  =====================================

``*_along_dim(x, dim, world_size, group)`` are the plain (not differentiable) collectives. With
one rank, or without torch.distributed, every function returns its input.

Example::

    out = reduce_forward_output(row_parallel_linear(x), group)
"""

from __future__ import annotations

import torch

from ..distributed import collectives as _c
from ..distributed.groups import world_size as _world_size
from ..errors import SyncError

__all__ = ["all_gather_along_dim", "reduce_scatter_along_dim", "scatter_along_dim", "all_gather_forward_output",
           "reduce_scatter_forward_output", "scatter_forward_output", "reduce_forward_output", "reduce_backward_grad"]


def _check(name: str, inp: torch.Tensor, dim: int, world_size, group, divisible: bool) -> int:
    if not isinstance(inp, torch.Tensor):
        raise SyncError(f"{name}: expects a tensor, got {type(inp).__name__}")
    if not -inp.dim() <= dim < inp.dim():
        raise SyncError(f"{name}: dim {dim} is out of range for a tensor of shape {tuple(inp.shape)}: valid are "
                        f"{-inp.dim()} .. {inp.dim() - 1}")
    actual = _world_size(group)
    if world_size is not None and world_size != actual:
        raise SyncError(f"{name}: world_size={world_size} but the group has {actual} ranks; pass "
                        f"world_size={actual} or a group of {world_size} ranks")
    if divisible and inp.shape[dim] % actual:
        raise SyncError(f"{name}: dimension {dim} of shape {tuple(inp.shape)} (size {inp.shape[dim]}) does not "
                        f"split evenly over {actual} ranks; its size must be divisible by {actual}")
    return dim % inp.dim()


def all_gather_along_dim(inp: torch.Tensor, dim: int, world_size: int, group) -> torch.Tensor:
    """Concatenate every rank's ``inp`` along ``dim``."""
    dim = _check("all_gather_along_dim", inp, dim, world_size, group, divisible=False)
    return _c.all_gather_tensor(inp, dim, group)


def reduce_scatter_along_dim(inp: torch.Tensor, dim: int, world_size: int, group) -> torch.Tensor:
    """Sum ``inp`` over the ranks and keep this rank's slice along ``dim``."""
    dim = _check("reduce_scatter_along_dim", inp, dim, world_size, group, divisible=True)
    return _c.reduce_scatter_tensor(inp, dim, group)


def scatter_along_dim(inp: torch.Tensor, dim: int, world_size: int, group) -> torch.Tensor:
    """This rank's slice of ``inp`` along ``dim``."""
    dim = _check("scatter_along_dim", inp, dim, world_size, group, divisible=True)
    return _c.local_slice(inp, dim, group)


def all_gather_forward_output(inp: torch.Tensor, dim: int, group, tensor_parallel_output_grad: bool = True):
    """All-gather along ``dim``. In backward the gradient is reduce-scattered when the consumer of
    the gathered value is itself sharded (each rank holds a partial gradient), else sliced."""
    dim = _check("all_gather_forward_output", inp, dim, None, group, divisible=False)
    return _c.gather_forward(inp, dim, group, grad_is_replicated=not tensor_parallel_output_grad)


def reduce_scatter_forward_output(inp: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Reduce-scatter along ``dim``; the gradient is all-gathered."""
    dim = _check("reduce_scatter_forward_output", inp, dim, None, group, divisible=True)
    return _c.reduce_scatter_forward(inp, dim, group)


def scatter_forward_output(inp: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Keep this rank's slice along ``dim``; the gradient is all-gathered."""
    dim = _check("scatter_forward_output", inp, dim, None, group, divisible=True)
    return _c.scatter_forward(inp, dim, group)


def reduce_forward_output(inp: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) in forward; identity in backward."""
    return _c.reduce_forward(inp, group)


def reduce_backward_grad(inp: torch.Tensor, group) -> torch.Tensor:
    """Identity in forward; all-reduce (sum) of the gradient in backward."""
    return _c.reduce_backward(inp, group)

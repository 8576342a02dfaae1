"""Sequence parallelism (Megatron-SP) with ``shard`` and ``sync``.

Tensor parallelism splits the matrix work of attention and MLP, but leaves the norms,
residual adds and dropouts between them replicated: every rank does all of that work on
the full ``(batch, seq, hidden)`` activations and keeps them in memory. Sequence
parallelism splits those parts along the sequence instead. Between two parallel regions the
activations live as sequence shards ``(batch, seq / world, hidden)``:

* a row-parallel linear's partial sums are *reduce-scattered* along the sequence
  (``sync(mode="fwd_post", sync_op_or_fn="reduce_scatter", axis=1)``) instead of all-reduced;
* the norm then runs on the sequence shard; its weights stay whole, and their gradients are
  summed over the group (:func:`make_sequence_parallel_norm`);
* its output is *all-gathered* along the sequence before the next column-parallel linears
  (``sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=1, tensor_parallel_output_grad=True)``:
  the column-parallel consumers each produce a partial input gradient, so the backward
  reduce-scatters it).

A reduce-scatter plus an all-gather move the same bytes as one all-reduce, so the
communication volume does not grow; the norms, residuals and dropouts do ``1 / world`` of the
work and keep ``1 / world`` of the activations. Dropout applied to sequence shards draws from
each rank's own random stream when the module is forked (``fork_rng``).

The sequence axis is 1 for HF's batch-first activations. The sequence length must be divisible
by the number of ranks: :class:`SplitSequence` refuses other lengths with a
:class:`~schedlang.errors.ScheduleValueError` naming the length and the nearest valid ones (pad the
batch: a causal model's logits at the real positions do not change, an encoder needs the padding
masked). ``shard_model(sch, sequence_parallel=True)`` (:mod:`schedlang.models`) writes these steps
for any model its automatic plan handles.
"""

from __future__ import annotations

import functools
from typing import Type

from torch import nn

from ..errors import ScheduleValueError
from .collectives import reduce_backward, scatter_forward
from .groups import world_size as _world_size
from .shard_rules.norm import is_sequence_parallel_norm, make_sequence_parallel_norm

__all__ = ["SplitSequence", "AllReduceGradient", "split_sequence", "sequence_parallel_norms",
           "make_sequence_parallel_norm", "is_sequence_parallel_norm", "SEQUENCE_AXIS"]

#: HF activations are (batch, seq, hidden)
SEQUENCE_AXIS = 1


class SplitSequence:
    """A sync function: keep this rank's slice of the sequence (backward: all-gather the gradient).

    Where the activations enter the sequence-parallel part of a model (the first decoder
    layer's input), every rank holds the full sequence; this keeps rank r's part r.

    Example::

        sch["model.layers.0"].sync(mode="fwd_pre", sync_op_or_fn=SplitSequence(axis=1))
    """

    def __init__(self, axis: int = SEQUENCE_AXIS, group=None, where: str = ""):
        self.axis = axis
        self.group = group
        self.where = where  # the schedule path, for messages

    def __call__(self, x):
        world = _world_size(self.group)
        length = x.shape[self.axis] if -x.dim() <= self.axis < x.dim() else None
        if world > 1 and length is not None and length % world:
            lower, upper = (length // world) * world, -(-length // world) * world
            valid = f"{lower} or {upper}" if lower else f"{upper}"
            raise ScheduleValueError(
                f"{self.where or '<root>'}: sequence parallelism splits axis {self.axis} of the input (shape "
                f"{tuple(x.shape)}) over {world} ranks, but its length {length} is not divisible by {world}; "
                f"pad the sequence to a multiple of {world} (e.g. {valid}) or shard without sequence_parallel")
        return scatter_forward(x, self.axis, self.group)

    def __deepcopy__(self, memo):  # process groups cannot be copied
        return SplitSequence(self.axis, self.group, self.where)

    def __repr__(self) -> str:
        return f"SplitSequence(axis={self.axis}, world_size={_world_size(self.group)})"


class AllReduceGradient:
    """A sync function: identity in forward, all-reduce of the gradient in backward.

    Megatron's operator at the entry of a tensor-parallel region, applied to a module's *output*
    (``mode="fwd_post"``): the same as ``sync(mode="bwd_post", sync_op_or_fn="all_reduce")`` on the
    module that consumes it, for consumers that are called with keyword arguments only.

    Example::

        sch["layers.0.input_layernorm"].sync(mode="fwd_post", sync_op_or_fn=AllReduceGradient())
    """

    def __init__(self, group=None):
        self.group = group

    def __call__(self, x):
        return reduce_backward(x, self.group)

    def __deepcopy__(self, memo):  # process groups cannot be copied
        return AllReduceGradient(self.group)

    def __repr__(self) -> str:
        return f"AllReduceGradient(world_size={_world_size(self.group)})"


def split_sequence(sch, axis: int = SEQUENCE_AXIS) -> None:
    """Record a step that splits the input of ``sch``'s module along the sequence (see :class:`SplitSequence`)."""
    sch.sync(mode="fwd_pre", sync_op_or_fn=SplitSequence(axis, sch.group, sch.path))


def sequence_parallel_norms(sch, norm_type: Type[nn.Module], group=None, only=None):
    """Record a step that makes every ``norm_type`` module under ``sch`` sequence-parallel.

    The norms keep their parameters (the same ``Parameter`` objects, so ``Verify`` compares their
    gradients and ``build`` initializes them as before); their forward sums the weight gradients
    over ``group`` (default: the schedule's group). ``only(path)`` can restrict which norms change.
    Returns the paths replaced.

    Example::

        sequence_parallel_norms(sch["model"], type(sch["model.norm"].mod))
    """
    group = sch.group if group is None else group
    make = functools.partial(_make_if, group=group, only=only)
    return sch.replace_all(norm_type, make)


def _make_if(path: str, module: nn.Module, group=None, only=None) -> nn.Module:
    if only is not None and not only(path):
        return module
    return make_sequence_parallel_norm(path, module, group=group)


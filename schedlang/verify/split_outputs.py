"""Outputs a schedule leaves split over the ranks on purpose: the vocabulary-parallel logits.

Tensor parallelism usually keeps the LM head's output split along the vocabulary (the loss is
then the vocabulary-parallel one, and no rank ever holds ``tokens x vocab`` values). Such a
model returns on each rank its slice of the logits, not the original's whole tensor. The
schedule's record says so: the model's output embeddings (``get_output_embeddings()``) are a
column-parallel projection whose output is not all-gathered, and its weight's :class:`ShardSpec`
says which slice of the vocabulary this rank holds.

:func:`split_heads` reads that record; :class:`SplitOutputs` matches the model's outputs against
it. An output whose shape is the original's except along the last axis, where it has the head's
local width instead of its full width, is compared as this rank's slice of the original's
output, and the random output gradient Verify sends back through it is the same slice of the
one the original gets. Gradients then agree with the original's: the head's input gradient is
summed over the ranks, each contributing its slice's part.

Context parallelism (``context_parallel``) splits outputs along the sequence instead (axis 1): each
``cp`` rank returns its tokens (:class:`SequenceSplit`), compared as the same tokens of the original's
output, with the same tokens of its output gradient. Each rank's parameter and input gradients then hold
only its tokens' part: :func:`sum_over_sequence_split` sums them over ``cp`` before they are compared.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..module_record import shard_specs, sync_specs

__all__ = ["SplitHead", "SplitOutputs", "split_heads", "SequenceSplit", "sequence_split", "sum_over_sequence_split"]


@dataclasses.dataclass(frozen=True)
class SplitHead:
    """A projection whose output this rank holds only a contiguous slice of, along its last axis."""

    path: str
    full: int  # the original output width
    start: int  # where this rank's slice begins
    local: int  # this rank's width

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a tensor of the original's width along its last axis."""
        return full.narrow(-1, self.start, self.local)

    def describe(self) -> str:
        return f"[{self.start}:{self.start + self.local}] of {self.full}"

    def note(self, name: str) -> str:
        return (f"{name}: split over the vocabulary ({self.path} is vocabulary-parallel), compared as this rank's "
                f"slice {self.describe()} of the original's; its output gradient likewise")


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """Outputs a context-parallel model returns for this rank's tokens only (axis 1), maybe also split
    over the vocabulary (``then``)."""

    cp: int
    rank: int
    then: Optional[SplitHead] = None

    def take(self, full: torch.Tensor) -> torch.Tensor:
        from ..distributed.context_parallel import split_sequence

        mine = split_sequence(full, 1, self.cp, self.rank)
        return self.then.take(mine) if self.then is not None else mine

    def note(self, name: str) -> str:
        vocabulary = f", and {self.then.note(name).split(': ', 1)[1]}" if self.then is not None else ""
        return (f"{name}: split over the sequence (context_parallel, cp={self.cp}), compared as this rank's tokens "
                f"of the original's; its output gradient likewise{vocabulary}")


def sequence_split(model: nn.Module):
    """The ``ContextParallelGroup`` ``context_parallel`` left on ``model`` (its root), or None."""
    found = getattr(model, "_schedlang_context_parallel", None)
    return found if found is not None and found.size > 1 else None


def sum_over_sequence_split(model: nn.Module, inputs: Sequence[torch.Tensor]) -> None:
    """Sum the parameter gradients of ``model`` and the gradients of ``inputs`` over its ``cp`` ranks, in
    place (each rank's gradient holds only what its tokens contributed); nothing without context parallelism."""
    cp_group = sequence_split(model)
    if cp_group is None:
        return
    import torch.distributed as dist

    for t in [p for p in model.parameters()] + list(inputs):
        if t.grad is not None:
            dist.all_reduce(t.grad, group=cp_group.group)


def _output_axis(module: nn.Module) -> Optional[int]:
    """The weight axis that holds a projection's output features (Linear: 0, HF Conv1D: 1), else None."""
    if isinstance(module, nn.Linear):
        return 0
    if any(k.__name__ == "Conv1D" for k in type(module).__mro__):
        return 1
    return None


def _output_embeddings(model: nn.Module) -> Optional[nn.Module]:
    getter = getattr(model, "get_output_embeddings", None)
    if not callable(getter):
        return None
    try:
        head = getter()
    except (NotImplementedError, AttributeError):  # a model without an LM head says so either way
        return None
    return head if isinstance(head, nn.Module) else None


def split_heads(model: nn.Module) -> List[SplitHead]:
    """The output heads of ``model`` (its output embeddings) whose outputs stay split over the vocabulary:
    column-parallel (weight split along the output features into equal contiguous parts), with no
    ``fwd_post`` all-gather."""
    head = _output_embeddings(model)
    if head is None:
        return []
    axis = _output_axis(head)
    spec = shard_specs(head).get("weight")
    if axis is None or spec is None or spec.axis != axis or spec.groups != 1:
        return []
    if any(s.op == "all_gather" for s in sync_specs(head, "fwd_post")):
        return []
    full = int(spec.full_shape[axis])
    local = full // spec.world_size
    path = next((name for name, m in model.named_modules() if m is head), "")
    return [SplitHead(path or "<root>", full, spec.rank * local, local)]


class SplitOutputs:
    """Which outputs of the scheduled model are this rank's slice of the original's.

    ``reference_shapes``: name -> shape of each output of the original model (from its run).
    """

    def __init__(self, heads: Sequence[SplitHead], reference_shapes: Dict[str, Tuple[int, ...]], sequence=None):
        self.heads = list(heads)
        self.reference_shapes = dict(reference_shapes)
        self.sequence = sequence  # the ContextParallelGroup of a context-parallel model, else None

    def head_for(self, name: str, shape: Sequence[int]):
        """The split ``name`` (an output of the given ``shape``) carries (a SplitHead or a SequenceSplit), or None."""
        expected = self.reference_shapes.get(name)
        if expected is None or len(expected) != len(shape) or not shape:
            return None
        cp = self.sequence
        if cp is not None and len(shape) >= 2 and shape[1] * cp.size == expected[1]:
            expected = (expected[0], shape[1]) + tuple(expected[2:])
            return SequenceSplit(cp.size, cp.rank, self._vocabulary_head(expected, shape))
        return self._vocabulary_head(expected, shape)

    def _vocabulary_head(self, expected, shape) -> Optional[SplitHead]:
        if tuple(expected[:-1]) != tuple(shape[:-1]):
            return None
        for head in self.heads:
            if expected[-1] == head.full and shape[-1] == head.local and head.local != head.full:
                return head
        return None

    def full_shape(self, name: str, shape: Sequence[int]) -> Tuple[int, ...]:
        """The original's shape of output ``name`` if it is split here, else ``shape`` itself."""
        return tuple(self.reference_shapes[name]) if self.head_for(name, shape) is not None else tuple(shape)

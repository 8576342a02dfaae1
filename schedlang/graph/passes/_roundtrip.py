"""Helpers of the round-trip rules: runs of consecutive pieces inside a tensor list."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
from torch import fx

from . import group_ops
from ._context import RewriteContext
from ._nodes import (
    Piece,
    SplitSpec,
    arg,
    is_call,
    num_pieces,
    piece_of,
    split_spec,
    tensor_shape,
)

__all__ = ["Run", "runs", "same_dim", "tensor_list", "CAT_FUNCTIONS", "run_source", "WholePieces", "PieceRuns",
           "ReturnedPieces", "StackedInput"]

CAT_FUNCTIONS = (torch.cat, torch.concat, torch.concatenate)


@dataclass
class Run:
    """``items[start:stop]`` are pieces ``first .. first + len - 1`` of ``spec``, in order."""

    start: int
    stop: int
    spec: SplitSpec
    pieces: List[Piece]

    @property
    def first(self) -> int:
        return self.pieces[0].index

    @property
    def count(self) -> int:
        return len(self.pieces)

    def covers_all(self) -> bool:
        total = num_pieces(self.spec)
        return self.first == 0 and total is not None and self.count == total



# ------------------------------------------------------------------ plans of the round-trip rules
@dataclass
class WholePieces:
    """Plan: the listed tensors are all the pieces of ``spec``, in order, joined along ``dim``."""

    spec: SplitSpec
    dim: Optional[int] = None


@dataclass
class PieceRuns:
    """Plan: in ``tensors`` (joined along ``dim``), each run of ``runs`` is replaced by its source."""

    tensors: Sequence[Any]
    dim: int
    runs: List[Run]


@dataclass
class ReturnedPieces:
    """Plan: the graph returns every piece of ``spec``, in order: it returns the split's tuple instead."""

    spec: SplitSpec


@dataclass
class StackedInput:
    """Plan: the node is a piece of an unbind of a stack, which is this input of the stack."""

    source: fx.Node

def runs(items: Sequence[Any], min_length: int = 2) -> List[Run]:
    """Maximal runs of consecutive pieces of one split/unbind inside ``items``."""
    found: List[Run] = []
    current: Optional[Run] = None
    for i, item in enumerate(items):
        piece = piece_of(item)
        if current is not None and piece is not None and piece.spec.node is current.spec.node \
                and piece.index == current.pieces[-1].index + 1:
            current.pieces.append(piece)
            current.stop = i + 1
            continue
        if current is not None:
            found.append(current)
        current = Run(i, i + 1, piece.spec, [piece]) if piece is not None else None
    if current is not None:
        found.append(current)
    return [r for r in found if r.count >= min_length or r.covers_all()]


def same_dim(a: int, b: int, like: Any) -> Optional[bool]:
    """Whether dims ``a`` and ``b`` of a tensor shaped like ``like`` are one; None if unknowable."""
    if a == b:
        return True
    if (a < 0) == (b < 0):
        return False
    shape = tensor_shape(like)
    if shape is None:
        return None
    return a % len(shape) == b % len(shape)


def tensor_list(node: fx.Node, functions) -> Optional[tuple]:
    """(tensors, dim) of a cat/stack call, else None."""
    if not is_call(node, functions):
        return None
    tensors = arg(node, 0, "tensors")
    dim = arg(node, 1, "dim", 0)
    if type(dim) is not int:
        return None
    return tensors, dim


def listed_pieces(node: fx.Node, functions) -> Optional[tuple]:
    """``(tensors, dim, whole)`` of a cat/stack call whose tensors are a list, or the whole
    result of one split / unbind (``whole`` is then its split spec, else None); None otherwise."""
    found = tensor_list(node, functions)
    if found is None:
        return None
    tensors, dim = found
    if isinstance(tensors, fx.Node):
        whole = split_spec(tensors)
        return None if whole is None else (tensors, dim, whole)
    return (tensors, dim, None) if isinstance(tensors, (list, tuple)) else None


def unbind_run_source(ctx: RewriteContext, run: Run) -> fx.Node:
    """The grouped tensor an unbind run's pieces came from, narrowed to the run when it is part of it."""
    spec = run.spec
    return spec.base if run.covers_all() else ctx.method("narrow", spec.base, spec.dim, run.first, run.count)


def run_source(ctx: RewriteContext, run: Run) -> Optional[fx.Node]:
    """A node equal to the concatenation of the run's pieces along the split dim (splits only).

    A run that ends with an int split's last piece of unknown size (it may be shorter) becomes
    :func:`~schedlang.graph.passes.group_ops.span_of_pieces`, which finds the end at run time.
    """
    spec = run.spec
    if run.covers_all():
        return spec.base
    first, last = run.pieces[0], run.pieces[-1]
    if first.offset is None or any(p.size is None for p in run.pieces[:-1]):
        return None
    if last.size is None:
        if type(spec.sizes) is not int or last.offset is None:
            return None
        return ctx.call(group_ops.span_of_pieces, spec.base, spec.dim, first.offset, last.offset + spec.sizes,
                        spec.sizes)
    length = sum(p.size for p in run.pieces)
    return ctx.method("narrow", spec.base, spec.dim, first.offset, length)

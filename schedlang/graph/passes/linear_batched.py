"""Rule ``linear_batched``: same-shape linears on different inputs become one batched matmul.

Before (``x0 .. x3`` of one shape, e.g. pieces of one split)::

    a = self.l0(x0); b = self.l1(x1); c = self.l2(x2); d = self.l3(x3)

After (weights stacked into one ``(N, out, in)`` parameter)::

    stacked = torch.stack([x0, x1, x2, x3], -2)
    y = group_ops.batched_linear(stacked, self.hfused_blinear_weight_0, self.hfused_blinear_bias_0, -2)
    unbind = y.unbind(-2)
    a = unbind[0]; ...

``batched_linear`` is one ``torch.baddbmm`` (``bmm`` without bias). Key: operand shape
(from metadata, or structure: the pieces of one split or unbind), ``in``/``out`` features,
dtype/device, bias. Members that depend on each other (``l1(l0(x))``) are never grouped.

Without shapes, the last piece of an int split along a dim other than the feature dim
(``x.split(5, 0)``, ``x.split(5, 1)`` of a 3-d ``x``) may be shorter than the others, so it
cannot be stacked with them. When the group is every piece ``0 .. N-1`` of the split, once
each, the rule emits instead::

    y = group_ops.piecewise_batched_linear(x, 5, 0, N, self.hfused_blinear_weight_0, self.hfused_blinear_bias_0)
    split_1 = y.split(5, 0)
    a = split_1[0]; ...

which checks at run time that all N pieces are whole (then: one ``baddbmm`` on a view of
``x``) and otherwise runs one ``F.linear`` per piece, exactly as before. The result is cut
like ``x``, so the rules that follow (a layer norm per piece, ``cat`` of the pieces) see the
pieces of a split again. A split along a non-negative dim with pieces of ``in_features``
rows might be the feature dim itself (a 1-d ``x``), where the results are ``out_features``
long, not ``size``: unless the two are equal, that last piece then stays apart and the
others are stacked, as when the group is not every piece.
"""

from __future__ import annotations

from typing import Hashable, List, Optional, Sequence, Tuple

from torch import fx

from . import group_ops
from ._build import (TensorRef, fuse_weights_and_biases, group_key, piece_order, replace_by_pieces,
                     replace_by_stacked_call, settled_members, stack_dim_for, unsettled)
from ._context import RewriteContext
from ._nodes import every_piece_once, piece_of
from .linear_same_input import LinearRule, linear_operands, linear_signature

_Operands = Tuple[fx.Node, TensorRef, Optional[TensorRef]]

__all__ = ["LinearBatched"]


class LinearBatched(LinearRule):
    name = "linear_batched"
    description = "same-shape linears on different inputs -> one batched matmul (baddbmm)"
    needs_independence = True

    def group_of(self, ctx: RewriteContext, x, weight, bias) -> Optional[Hashable]:
        # an int split's last piece of unknown size joins its siblings: rewrite guards it or leaves it apart
        key = group_key(ctx, x, weight.value.shape[1], short_pieces=True)
        # with the shape unknown, nothing proves that the operands stack
        return None if key[0] == "node" else (key, weight.value.shape[0]) + linear_signature(weight, bias)

    def rewrite(self, ctx: RewriteContext, key: Hashable, members: List[fx.Node]) -> bool:
        operands = [linear_operands(ctx, m) for m in members]
        in_f = operands[0][1].value.shape[1]
        if any(unsettled(o[0], in_f) for o in operands):
            if every_piece_once([o[0] for o in operands]) and _pieces_keep_their_length(operands):
                return self._rewrite_piecewise(ctx, members, operands)
            settled = settled_members(ctx, members, operands, in_f)
            if settled is None:
                return False
            members, operands = settled
        inputs = [o[0] for o in operands]
        weights = [o[1] for o in operands]
        biases = [o[2] for o in operands]
        dim = stack_dim_for(inputs, -2)
        if not (dim == 0 or dim <= -2):
            dim = -2
        n = len(members)
        with ctx.graph.inserting_before(members[0]):
            w, b = fuse_weights_and_biases(ctx, "blinear", weights, biases, "stack")
        out_f, in_f = weights[0].value.shape
        replace_by_stacked_call(ctx, self.name, members, inputs, dim,
                                lambda grouped: ctx.call(group_ops.batched_linear, grouped, w, b, dim),
                                f"{n} x linear({in_f}->{out_f}) on different inputs -> 1 batched_linear "
                                f"(baddbmm over {n} stacked inputs)")
        return True

    def _rewrite_piecewise(self, ctx: RewriteContext, members: List[fx.Node], operands: List[_Operands]) -> bool:
        """Every piece of an int split, whose last piece may be shorter -> one guarded batched linear."""
        order = piece_order([o[0] for o in operands])
        spec = piece_of(operands[0][0]).spec
        weights = [operands[i][1] for i in order]
        biases = [operands[i][2] for i in order]
        n = len(members)
        with ctx.graph.inserting_before(members[0]):
            w, b = fuse_weights_and_biases(ctx, "blinear", weights, biases, "stack")
            y = ctx.call(group_ops.piecewise_batched_linear, spec.base, spec.sizes, spec.dim, n, w, b)
        out_f, in_f = weights[0].value.shape
        # the result holds exactly the n pieces (a part of the input after them is not used)
        replace_by_pieces(ctx, self.name, members, order, y, spec, n,
                          f"{n} x linear({in_f}->{out_f}) on the pieces of '{spec.node.name}' -> 1 "
                          f"piecewise_batched_linear on '{spec.base.name}' (one baddbmm when all {n} pieces are "
                          "whole, else one linear per piece)")
        return True


def _pieces_keep_their_length(operands: Sequence[_Operands]) -> bool:
    """Whether each result, cut from the joined result with the split's own size, is a whole result.

    True unless the split dim may be the feature dim: a negative dim before the last is not;
    nor is a dim whose pieces are not ``in_features`` long (piece 0 is whole, and a linear
    would reject it). Along the feature dim, each result is ``out_features`` long.
    """
    spec = piece_of(operands[0][0]).spec
    out_f, in_f = operands[0][1].value.shape
    return spec.dim <= -2 or spec.sizes != in_f or out_f == in_f

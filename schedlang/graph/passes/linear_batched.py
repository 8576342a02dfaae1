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
"""

from __future__ import annotations

from typing import Hashable, List, Optional

from torch import fx

from . import group_ops
from ._build import fuse_tensors, group_key, stack, stack_dim_for, unstack
from ._context import RewriteContext
from .linear_same_input import LinearRule, linear_operands, linear_signature

__all__ = ["LinearBatched"]


class LinearBatched(LinearRule):
    name = "linear_batched"
    description = "same-shape linears on different inputs -> one batched matmul (baddbmm)"
    needs_independence = True

    def group_of(self, ctx: RewriteContext, x, weight, bias) -> Optional[Hashable]:
        key = group_key(ctx, x, weight.value.shape[1])
        # with the shape unknown, nothing proves that the operands stack
        return None if key[0] == "node" else (key, weight.value.shape[0]) + linear_signature(weight, bias)

    def rewrite(self, ctx: RewriteContext, key: Hashable, members: List[fx.Node]) -> bool:
        operands = [linear_operands(ctx, m) for m in members]
        inputs = [o[0] for o in operands]
        weights = [o[1] for o in operands]
        biases = [o[2] for o in operands]
        dim = stack_dim_for(inputs, -2)
        if not (dim == 0 or dim <= -2):
            dim = -2
        n = len(members)
        with ctx.graph.inserting_before(members[0]):
            w = fuse_tensors(ctx, "blinear_weight", weights, "stack", 0)
            b = fuse_tensors(ctx, "blinear_bias", biases, "stack", 0) if biases[0] is not None else None
            grouped = stack(ctx, inputs, dim)
            y = ctx.call(group_ops.batched_linear, grouped, w, b, dim)
            outs = unstack(ctx, y, dim, n)
        out_f, in_f = weights[0].value.shape
        ctx.record(self.name, members, y, f"{n} x linear({in_f}->{out_f}) on different inputs -> 1 batched_linear "
                                          f"(baddbmm over {n} stacked inputs)")
        for m, out in zip(members, outs):
            ctx.replace(m, out)
        return True

"""Rule ``cat_unbind``: concatenating the pieces of an unbind is a move and a flatten.

Before (the end of the seed chain, after the layer norm and tanh were fused)::

    unbind = tanh.unbind(-2)                                # tanh: (B, N, D)
    y = torch.cat([unbind[0], ..., unbind[N-1]], -1)        # (B, N*D)

After: ``y = tanh.flatten(-2, -1)`` (a view when ``tanh`` is contiguous). A run of
consecutive pieces inside a longer list becomes a ``narrow`` first.
"""

from __future__ import annotations

from torch import fx

from . import group_ops
from ._context import RewriteContext, SimplifyRule
from ._roundtrip import CAT_FUNCTIONS, PieceRuns, WholePieces, listed_pieces, runs, unbind_run_source

__all__ = ["CatUnbind"]


def merge(ctx: RewriteContext, grouped: fx.Node, group_dim: int, dim: int) -> fx.Node:
    """Node for ``torch.cat(grouped.unbind(group_dim), dim)``."""
    if group_dim < 0 and dim < 0:
        moved = grouped if group_dim == dim - 1 else ctx.method("movedim", grouped, group_dim, dim - 1)
        return ctx.method("flatten", moved, dim - 1, dim)
    if group_dim >= 0 and dim >= 0:
        moved = grouped if group_dim == dim else ctx.method("movedim", grouped, group_dim, dim)
        return ctx.method("flatten", moved, dim, dim + 1)
    return ctx.call(group_ops.merge_group_dim, grouped, group_dim, dim)


class CatUnbind(SimplifyRule):
    name = "cat_unbind"
    description = "cat of the pieces of an unbind -> movedim + flatten of its input"

    def plan(self, node: fx.Node):
        found = listed_pieces(node, CAT_FUNCTIONS)
        if found is None:
            return None
        tensors, dim, whole = found
        if whole is not None:
            return WholePieces(whole, dim) if whole.kind == "unbind" else None
        usable = [r for r in runs(tensors) if r.spec.kind == "unbind"]
        return PieceRuns(tensors, dim, usable) if usable else None

    def apply(self, ctx: RewriteContext, node: fx.Node, plan) -> bool:
        with ctx.graph.inserting_before(node):
            if isinstance(plan, WholePieces):
                spec, dim = plan.spec, plan.dim
                result = merge(ctx, spec.base, spec.dim, dim)
                n_in = "all"
            else:
                tensors, dim = plan.tensors, plan.dim
                items = list(tensors)
                for run in reversed(plan.runs):
                    items[run.start:run.stop] = [merge(ctx, unbind_run_source(ctx, run), run.spec.dim, dim)]
                result = items[0] if len(items) == 1 else ctx.call(node.target, items, dim)
                n_in = str(len(tensors))
        ctx.record(self.name, [node], result, f"cat of {n_in} unbind pieces -> flatten of the grouped tensor")
        ctx.replace(node, result)
        return True

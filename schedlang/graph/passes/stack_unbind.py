"""Rule ``stack_unbind``: stacking the pieces of an unbind (or equal pieces of a split) is a view.

The fusion rules stack their operands and unbind their results; chained, they leave
``torch.stack(y.unbind(g), g)`` between two batched ops. This rule removes such round trips:

* ``torch.stack([u[0], ..., u[N-1]], g)`` with ``u = t.unbind(g)`` -> ``t``
  (a ``movedim`` if stacked along another dim, a ``narrow`` for a run of pieces);
* ``torch.stack([s[0], ..., s[N-1]], -2)`` with ``s = x.split(D, -1)`` ->
  ``x.unflatten(-1, (N, D))`` (the "(B, N*D) -> (B, N, D)" view of the seed post);
* ``t.unbind(g)[i]`` with ``t = torch.stack(xs, g)`` -> ``xs[i]``.
"""

from __future__ import annotations

import torch
from torch import fx

from ._context import RewriteContext, SimplifyRule
from ._nodes import piece_of
from ._roundtrip import PieceRuns, StackedInput, WholePieces, listed_pieces, runs, same_dim, tensor_list
from ._roundtrip import unbind_run_source

__all__ = ["StackUnbind"]


class StackUnbind(SimplifyRule):
    name = "stack_unbind"
    description = "stack of unbind pieces / equal split pieces -> a view; unbind of a stack -> its inputs"

    def plan(self, node: fx.Node):
        piece = piece_of(node)
        if piece is not None and piece.spec.kind == "unbind":
            found = tensor_list(piece.spec.base, (torch.stack,))
            if found is not None and isinstance(found[0], (list, tuple)) and \
                    same_dim(found[1], piece.spec.dim, piece.spec.base) and piece.index < len(found[0]):
                return StackedInput(found[0][piece.index])
            return None
        found = listed_pieces(node, (torch.stack,))
        if found is None:
            return None
        tensors, dim, whole = found
        if whole is not None:
            return WholePieces(whole, dim) if whole.kind == "unbind" else None
        found_runs = runs(tensors)
        if len(found_runs) != 1 or found_runs[0].start != 0 or found_runs[0].stop != len(tensors):
            return None
        run = found_runs[0]
        if run.spec.kind == "split":
            sizes = {p.size for p in run.pieces} - {None}
            # a valid stack has equal shapes, so an int split's possibly shorter last piece is whole here
            if len(sizes) != 1 or run.pieces[0].offset is None:
                return None
        return PieceRuns(tensors, dim, [run])

    def apply(self, ctx: RewriteContext, node: fx.Node, plan) -> bool:
        if isinstance(plan, StackedInput):
            ctx.record(self.name, [node], plan.source, f"unbind(stack(...))[i] -> '{plan.source.name}'")
            ctx.replace(node, plan.source)
            return True
        with ctx.graph.inserting_before(node):
            if isinstance(plan, WholePieces):
                spec, dim = plan.spec, plan.dim
                result = self._move(ctx, spec.base, spec.dim, dim)
            else:
                (run,), dim = plan.runs, plan.dim
                spec = run.spec
                if spec.kind == "unbind":
                    result = self._move(ctx, unbind_run_source(ctx, run), spec.dim, dim)
                else:
                    size = next(p.size for p in run.pieces if p.size is not None)
                    whole = run.covers_all()
                    source = spec.base if whole else ctx.method("narrow", spec.base, spec.dim, run.pieces[0].offset,
                                                                run.count * size)
                    grouped = ctx.method("unflatten", source, spec.dim, (run.count, size))
                    group_dim = spec.dim - 1 if spec.dim < 0 else spec.dim
                    result = self._move(ctx, grouped, group_dim, dim)
        ctx.record(self.name, [node], result, f"stack of {'whole' if isinstance(plan, WholePieces) else 'run'} pieces -> view of '{result.name}'")
        ctx.replace(node, result)
        return True

    @staticmethod
    def _move(ctx: RewriteContext, tensor: fx.Node, source: int, target: int) -> fx.Node:
        if same_dim(source, target, tensor):
            return tensor
        return ctx.method("movedim", tensor, source, target)

"""Rule ``split_cat``: concatenating the pieces of a split, in order, gives back its input.

Before::

    split = x.split([16, 16, 32], -1)
    y = torch.cat([split[0], split[1], split[2]], -1)      # or torch.cat(split, -1)

After: ``y = x``. A consecutive run of pieces inside a longer list becomes one
``narrow`` view of ``x`` (``torch.cat([a, split[1], split[2], b])`` ->
``torch.cat([a, x.narrow(-1, 16, 48), b])``). The cat must be along the split's dim. A run
that ends with the last piece of an int split whose size is not known (it may be shorter)
becomes ``group_ops.span_of_pieces(x, dim, start, stop, size)``: ``x`` itself, or a
``narrow`` view, whichever the length of ``x`` at run time says.

Also: a forward that returns the tuple of all the pieces of a split or unbind, in order,
returns the split's own tuple (no getitem per piece on every call).
"""

from __future__ import annotations

from torch import fx

from ._context import RewriteContext, SimplifyRule
from ._roundtrip import CAT_FUNCTIONS, PieceRuns, ReturnedPieces, WholePieces, listed_pieces, run_source, runs, same_dim

__all__ = ["SplitCat"]


class SplitCat(SimplifyRule):
    name = "split_cat"
    description = "cat of the pieces of a split, in order, along its dim -> the split's input (or a narrow view)"

    def plan(self, node: fx.Node):
        if node.op == "output":
            value = node.args[0] if node.args else None
            if isinstance(value, tuple) and value:
                found = runs(value, min_length=1)
                if len(found) == 1 and found[0].start == 0 and found[0].stop == len(value) and found[0].covers_all():
                    return ReturnedPieces(found[0].spec)
            return None
        found = listed_pieces(node, CAT_FUNCTIONS)
        if found is None:
            return None
        tensors, dim, spec = found
        if spec is not None:
            return WholePieces(spec) if spec.kind == "split" and same_dim(spec.dim, dim, spec.base) else None
        usable = [r for r in runs(tensors) if r.spec.kind == "split" and same_dim(r.spec.dim, dim, r.spec.base)]
        return PieceRuns(tensors, dim, usable) if usable else None

    def apply(self, ctx: RewriteContext, node: fx.Node, plan) -> bool:
        if isinstance(plan, ReturnedPieces):
            spec = plan.spec
            pieces = list(node.args[0])
            node.args = (spec.node,) + tuple(node.args[1:])
            for p in pieces:
                ctx.erase(p)
            ctx.record(self.name, pieces, spec.node, f"returns all {len(pieces)} pieces of '{spec.node.name}' -> "
                                                     f"returns its tuple")
            return True
        if isinstance(plan, WholePieces):
            base = plan.spec.base
            ctx.record(self.name, [node], base, f"cat(split('{base.name}')) -> '{base.name}'")
            ctx.replace(node, base)
            return True
        tensors, dim, usable = plan.tensors, plan.dim, plan.runs
        items = list(tensors)
        changed = False
        with ctx.graph.inserting_before(node):
            for run in reversed(usable):
                source = run_source(ctx, run)
                if source is not None:
                    items[run.start:run.stop] = [source]
                    changed = True
            if not changed:
                return False
            result = items[0] if len(items) == 1 else ctx.call(node.target, items, dim)
        ctx.record(self.name, [node], result, f"cat of {len(tensors)} tensors -> {len(items)} "
                                              f"(runs of split pieces replaced by their source)")
        ctx.replace(node, result)
        return True

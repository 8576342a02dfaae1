"""Reverse-mode differentiation over the fused-kernel IR (:mod:`schedlang.lowering.ir`).

The backward kernel recomputes the forward values it needs from the saved inputs (cheap:
they are pointwise or in-register row reductions) and then evaluates the expressions
built here.

Gradients are kept *unreduced*: the gradient ``G`` attached to a value ``v`` may span
more axes than ``v`` (a bias of kind ``col`` receives a ``full`` gradient). The true
gradient of ``v`` is ``G`` summed over the axes ``v`` does not span. This is exact because
every local derivative of a value is constant along the axes the value does not span, so
the sum can be pushed down to the leaves: a bias gradient is then one column sum at the
very end instead of a cross-row reduction in the middle of the kernel. Two places must
reduce early:

* a value without a column axis (a row statistic such as a mean or a variance, a scalar)
  sums each incoming contribution over the columns before adding it up (in registers:
  rows are whole in one tile). Contributions that span columns and contributions that do
  not would otherwise be added as if they meant the same thing. Every gradient spans the
  row axis (see below), so no such care is needed for rows.

Outputs that do not span rows (a ``col`` output computed from weights only) receive their
incoming gradient on row 0 alone, so that the final sum over rows counts it once.

Example::

    g = Graph()
    x = g.input(0, rows=True, cols=True, name="x")
    y = g.mul(x, x)
    (dx,) = derive_gradients(g, [y], [g.grad_output(0, True, True, "dy")], [x])
    # dx is dy * x + dy * x, folded and CSE'd by the builder
"""

from __future__ import annotations

from .ir import Graph, Value
from .ir_ops import IR_OPS

__all__ = ["derive_gradients"]

def derive_gradients(g: Graph, outputs: list[Value], grad_outputs: list[Value | None],
                     wrt: list[Value]) -> list[Value | None]:
    """Build the gradients of ``outputs`` (weighted by ``grad_outputs``) w.r.t. ``wrt``.

    Returns one unreduced gradient per entry of ``wrt`` (``None`` where no output depends
    on it). New values are built in ``g`` with the origin ``("grad", <forward origin>)``.
    """
    grads: dict[int, Value] = {}
    g.track_squeeze = False

    def accumulate(v: Value, contribution: Value):
        if v.is_bool or v.op in ("const", "ncols", "keep_mask"):
            return
        if contribution.cols and not v.cols:
            # v has no column axis: sum the contribution over the row now (in registers),
            # so that every term added up below means the same thing
            contribution = g.rowsum(contribution)
        previous = grads.get(v.id)
        grads[v.id] = contribution if previous is None else g.add(previous, contribution)

    for out, grad in zip(outputs, grad_outputs):
        if grad is None or out is None:
            continue
        g.set_origin(("grad", out.origin))
        accumulate(out, grad if out.rows else g.row0(grad))

    for v in reversed(g.reachable(outputs)):
        grad = grads.get(v.id)
        if grad is None or not v.args:
            continue
        g.set_origin(("grad", v.origin))
        for arg, contribution in _vjp(g, v, grad):
            accumulate(arg, contribution)
    g.set_origin(None)
    g.track_squeeze = True
    return [grads.get(w.id) for w in wrt]


def _vjp(g: Graph, v: Value, grad: Value):
    """``(operand, contribution)`` pairs for the value ``v`` with gradient ``grad``."""
    rule = IR_OPS[v.op].vjp
    if rule is None:  # pragma: no cover - every op with operands has a rule in IR_OPS
        raise NotImplementedError(f"no derivative for IR op {v.op!r}")
    return rule(g, v, grad)

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

import math

from .ir import Graph, Value

__all__ = ["derive_gradients"]

_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


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
    """Yield ``(operand, contribution)`` pairs for the value ``v`` with gradient ``grad``."""
    op, args = v.op, v.args
    if op == "add":
        yield args[0], grad
        yield args[1], grad
    elif op == "sub":
        yield args[0], grad
        yield args[1], g.neg(grad)
    elif op == "mul":
        a, b = args
        yield a, g.mul(grad, b)
        yield b, g.mul(grad, a)
    elif op == "div":
        a, b = args
        yield a, g.div(grad, b)
        yield b, g.neg(g.div(g.mul(grad, v), b))  # d(a/b)/db = -(a/b)/b
    elif op == "neg":
        yield args[0], g.neg(grad)
    elif op == "exp":
        yield args[0], g.mul(grad, v)
    elif op == "log":
        yield args[0], g.div(grad, args[0])
    elif op == "sqrt":
        yield args[0], g.div(g.mul(grad, 0.5), v)
    elif op == "rsqrt":  # d x^-1/2 = -1/2 x^-3/2 = -1/2 v^3
        yield args[0], g.mul(grad, g.mul(g.mul(v, g.mul(v, v)), -0.5))
    elif op == "tanh":
        yield args[0], g.mul(grad, g.sub(1.0, g.mul(v, v)))
    elif op == "sigmoid":
        yield args[0], g.mul(grad, g.mul(v, g.sub(1.0, v)))
    elif op == "erf":
        a = args[0]
        yield a, g.mul(grad, g.mul(g.exp(g.neg(g.mul(a, a))), _TWO_OVER_SQRT_PI))
    elif op == "abs":  # sign(a), 0 at 0 as in PyTorch
        a = args[0]
        sign = g.where(g.compare("gt", a, 0.0), 1.0, g.where(g.compare("lt", a, 0.0), -1.0, 0.0))
        yield a, g.mul(grad, sign)
    elif op == "relu":  # PyTorch: zero gradient at 0
        yield args[0], g.where(g.compare("gt", args[0], 0.0), grad, 0.0)
    elif op in ("maximum", "minimum"):  # ties split the gradient evenly, as PyTorch does
        a, b = args
        wins = g.compare("gt" if op == "maximum" else "lt", a, b)
        tie = g.compare("eq", a, b)
        half = g.mul(grad, 0.5)
        yield a, g.where(wins, grad, g.where(tie, half, 0.0))
        yield b, g.where(wins, 0.0, g.where(tie, half, grad))
    elif op == "where":
        cond, a, b = args
        yield a, g.where(cond, grad, 0.0)
        yield b, g.where(cond, 0.0, grad)
    elif op in ("round", "row0", "alias", "broadcast"):
        # a cast's gradient is cast back: identity in the compute dtype
        yield args[0], grad
    elif op == "rowsum":
        yield args[0], g.rowsum(grad)  # true gradient of the sum, broadcast over columns
    elif op == "rowmax":
        if v.attr("grad"):
            # the gradient goes to the maxima, split evenly among ties (as torch.amax)
            a = args[0]
            is_max = g.compare("eq", a, v)
            count = g.rowsum(g.where(is_max, 1.0, 0.0))
            yield a, g.where(is_max, g.div(g.rowsum(grad), count), 0.0)
    else:  # pragma: no cover - every op built by op_table has a rule above
        raise NotImplementedError(f"no derivative for IR op {op!r}")

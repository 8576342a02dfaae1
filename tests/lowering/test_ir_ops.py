"""The IR op table: every op is complete, folds like its PyTorch reference, differentiates like
PyTorch's autograd of that reference, and every PyTorch function it claims lowers to it."""

from __future__ import annotations

import math

import pytest
import torch

from schedlang.lowering.autodiff import derive_gradients
from schedlang.lowering.ir import BINARY_OPS, COMPARE_OPS, LEAF_OPS, REDUCE_OPS, UNARY_OPS, Graph
from schedlang.lowering.ir_ops import IR_OPS, evaluate

from .utils import check_fused

ROWS, COLS = 5, 7  # irregular on purpose


def test_every_op_is_complete():
    for name, op in IR_OPS.items():
        if op.category == "leaf":
            assert op.arity == 0 and op.vjp is None, name
            continue
        assert op.eager is not None and op.triton is not None, name
        if op.category != "compare":  # booleans carry no gradient
            assert op.vjp is not None, name
        if op.category in ("unary", "binary", "compare"):
            assert op.fold is not None, name
    # the builder's op sets are read from the table
    assert UNARY_OPS | BINARY_OPS | COMPARE_OPS | REDUCE_OPS | LEAF_OPS | {"where"} == set(IR_OPS)


def _domain(name):
    if name in ("log", "sqrt", "rsqrt"):
        return [0.3, 1.7, 4.0]
    return [-1.3, -0.2, 0.4, 2.5]


@pytest.mark.parametrize("name", sorted(n for n, op in IR_OPS.items() if op.category in ("unary", "binary", "compare")))
def test_fold_matches_the_pytorch_reference(name):
    op = IR_OPS[name]
    xs = _domain(name)
    pairs = [(x,) for x in xs] if op.arity == 1 else [(x, y) for x in xs for y in xs]
    for args in pairs:
        if name in ("and", "or"):
            args = tuple(a > 0 for a in args)
            tensors = [torch.tensor(a) for a in args]
        else:
            tensors = [torch.tensor(a, dtype=torch.float64) for a in args]
        want = op.eager(None, *tensors)
        got = op.fold(*args)
        if want.dtype == torch.bool:
            assert bool(got) == bool(want), (name, args)
        else:
            assert math.isclose(got, float(want), rel_tol=1e-12, abs_tol=1e-12), (name, args, got, float(want))


def _build(name, g, x, y, c):
    op = IR_OPS[name]
    if op.category == "unary":
        return g.unary(name, x) if name in ("exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "erf", "abs", "relu") \
            else g.neg(x)
    if op.category == "binary":
        return getattr(g, name)(x, y)
    if name == "where":
        return g.where(c, x, y)
    if name == "rowsum":
        return g.rowsum(x)
    if name == "rowmax":
        return g.rowmax(x)
    if name == "round":
        return g.round_to(x, "bfloat16")
    if name == "broadcast":
        return g.broadcast(g.rowsum(x), True, True)
    raise AssertionError(name)


# row0 and alias only appear inside derived gradients (row0 injects a row-invariant gradient
# once; alias marks a reshape of the same numbers), so they have no forward to differentiate
DIFFERENTIABLE = sorted(n for n, op in IR_OPS.items()
                        if op.vjp is not None and n not in ("row0", "alias"))


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_derivative_matches_autograd_of_the_reference(name):
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    low = 0.3 if name in ("log", "sqrt", "rsqrt") else -2.0
    x = (torch.rand(ROWS, COLS, generator=gen, dtype=torch.float64) * 2.5 + low).requires_grad_()
    y = (torch.rand(ROWS, COLS, generator=gen, dtype=torch.float64) * 2.5 + 0.3).requires_grad_()
    cond = torch.rand(ROWS, COLS, generator=gen) > 0.5
    g = Graph()
    xv = g.input(0, True, True, "x")
    yv = g.input(1, True, True, "y")
    cv = g.input(2, True, True, "c", is_bool=True)
    out = _build(name, g, xv, yv, cv)
    gout = g.grad_output(0, out.rows, out.cols, "dout")
    dx, dy = derive_gradients(g, [out], [gout], [xv, yv])

    upstream = torch.randn(ROWS, COLS if out.cols else 1, generator=gen, dtype=torch.float64)
    values = evaluate(g.reachable([out, dx, dy]), {0: x.detach(), 1: y.detach(), 2: cond}, COLS, {0: upstream})
    # the reference: PyTorch's autograd through the op's own eager reference
    ref_out = evaluate(g.reachable([out]), {0: x, 1: y, 2: cond}, COLS)[out.id]
    torch.testing.assert_close(values[out.id].expand_as(ref_out), ref_out.detach())
    want = torch.autograd.grad(ref_out, [x, y], upstream.expand_as(ref_out), allow_unused=True)
    for got_value, wanted in zip((dx, dy), want):
        if wanted is None or not wanted.abs().sum():
            assert got_value is None or not values[got_value.id].abs().sum()
            continue
        # gradients are unreduced: summed over the axes the operand does not span (here none).
        # A cast's gradient stays in the compute dtype where PyTorch rounds it to the cast's
        # dtype, so round is compared at bf16 precision.
        tol = dict(rtol=1.6e-2, atol=1e-2) if name == "round" else dict(rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(values[got_value.id].expand_as(wanted), wanted, **tol)


def test_a_wrong_derivative_is_caught(monkeypatch):
    """The check above can fail: a tanh with the derivative of sigmoid does not pass."""
    import dataclasses

    monkeypatch.setitem(IR_OPS, "tanh", dataclasses.replace(IR_OPS["tanh"], vjp=IR_OPS["sigmoid"].vjp))
    with pytest.raises(AssertionError):
        test_derivative_matches_autograd_of_the_reference("tanh")


@pytest.mark.parametrize("name", sorted(n for n, op in IR_OPS.items() if op.torch_functions))
def test_listed_pytorch_functions_lower_to_the_op(name):
    op = IR_OPS[name]
    fn = op.torch_functions[-1]
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(3, 2, 13, generator=gen) * 2 + (0.2 if name in ("log", "sqrt", "rsqrt") else -1.0)
    if op.category == "compare":
        check_fused(lambda a, b: torch.where(fn(a, b), a, b * 2.0), [x, x.flip(-1)])
    else:
        check_fused(lambda a: fn(a) * 1.5, [x])

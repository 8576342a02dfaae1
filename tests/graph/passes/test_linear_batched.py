import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from schedlang.graph.passes import group_ops
from schedlang.graph.passes.group_ops import piecewise_batched_linear

from .models import BranchesOnPieces, check_fusion, compare_with_model, count_calls, randomize


class Towers(nn.Module):
    def __init__(self, n=3, d_in=5, d_out=4, bias=True):
        super().__init__()
        self.towers = nn.ModuleList(nn.Linear(d_in, d_out, bias=bias) for _ in range(n))

    def forward(self, x0, x1, x2):
        return tuple(t(x) for t, x in zip(self.towers, (x0, x1, x2)))


def _with_shapes(model, inputs):
    gm = fx.symbolic_trace(model)
    ShapeProp(gm).propagate(*inputs)
    return gm


def test_linears_on_inputs_of_one_shape_become_one_batched_matmul():
    for bias in (True, False):
        model = randomize(Towers(bias=bias))
        inputs = [torch.randn(2, 7, 5) for _ in range(3)]
        gm, report = check_fusion(model, inputs, gm=_with_shapes(model, inputs), rules=["linear_batched"])
        assert count_calls(gm) == {"stack": 1, "batched_linear": 1, "unbind": 1, "getitem": 3}
        assert report.records[0].detail == "3 x linear(5->4) on different inputs -> 1 batched_linear (baddbmm over 3 " \
                                           "stacked inputs)"
        weight = next(p for n, p in gm.named_parameters() if "weight" in n)
        assert weight.shape == (3, 4, 5)


def test_inputs_of_different_or_unknown_shapes_are_not_batched():
    model = randomize(Towers())
    inputs = [torch.randn(7, 5), torch.randn(6, 5), torch.randn(7, 5)]
    gm, report = check_fusion(model, inputs, gm=_with_shapes(model, inputs), rules=["linear_batched"])
    assert [r.members for r in report.records] == [("towers_0", "towers_2")]
    _, report = check_fusion(model, inputs, rules=["linear_batched"])  # no shapes recorded: nothing is provable
    assert len(report) == 0


def test_pieces_of_one_split_are_batched_without_shapes():
    # float64: a layer norm over two values is ill-conditioned, and bmm and mm round differently
    model = randomize(BranchesOnPieces(n=4, d_in=3, d=2)).double()
    gm, report = check_fusion(model, [torch.randn(9, 12, dtype=torch.float64)], rules=["linear_batched"])
    assert report.counts == {"linear_batched": 1} and count_calls(gm)["batched_linear"] == 1


# ------------------------------------------------------------------ the pieces of an int split, the last maybe shorter
_DTYPE_TOLERANCES = [(torch.float32, 1e-5, 1.3e-6), (torch.bfloat16, 3e-2, 1.6e-2), (torch.float16, 5e-3, 1e-3)]


def _counting_batched_linear(monkeypatch):
    """Patch ``group_ops.batched_linear`` to count its calls (the grouped path of the piecewise op)."""
    calls = []
    original = group_ops.batched_linear
    monkeypatch.setattr(group_ops, "batched_linear", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize("shape,dim,grouped", [
    ((7 * 5, 13), 0, True),            # every piece whole
    ((7 * 5 - 2, 13), 0, False),       # the last piece has 3 rows
    ((7 * 5 + 4, 13), 0, True),        # a part after the pieces, not used
    ((3, 7 * 5 - 4, 13), 1, False),    # a middle dim
    ((3, 7 * 5, 2, 13), -3, True),
    ((2, 7 * 13), 1, True)])           # the feature dim itself: pieces of in_features
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype,atol,rtol", _DTYPE_TOLERANCES)
def test_piecewise_batched_linear_is_one_linear_per_piece_whatever_the_length(shape, dim, grouped, bias, dtype, atol,
                                                                              rtol, monkeypatch):
    calls = _counting_batched_linear(monkeypatch)
    size = 13 if shape[dim] == 7 * 13 else 5
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    w = torch.randn(7, 11 if size != 13 else 13, 13, dtype=dtype, requires_grad=True)
    b = torch.randn(7, w.shape[1], dtype=dtype, requires_grad=True) if bias else None
    out = piecewise_batched_linear(x, size, dim, 7, w, b)
    assert out.dtype == dtype and len(calls) == int(grouped)
    pieces = x.split(size, dim)
    expected = [F.linear(pieces[i], w[i], None if b is None else b[i]) for i in range(7)]
    got = list(out.split(size, dim))
    assert len(got) == 7  # exactly the pieces used: the part after them is dropped
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, atol=atol * max(1.0, e.abs().max().item()), rtol=rtol)
    leaves = [t for t in (x, w, b) if t is not None]
    gs = [torch.randn_like(e) for e in expected]
    for a, e in zip(torch.autograd.grad(got, leaves, gs), torch.autograd.grad(expected, leaves, gs)):
        torch.testing.assert_close(a, e, atol=atol * max(1.0, e.abs().max().item()), rtol=rtol)


def test_piecewise_batched_linear_raises_like_the_split_when_a_piece_is_missing():
    w = torch.randn(7, 11, 13)
    with pytest.raises(IndexError):
        piecewise_batched_linear(torch.randn(6 * 5, 13), 5, 0, 7, w, None)  # piece 6 does not exist
    with pytest.raises(IndexError, match="Dimension out of range"):
        piecewise_batched_linear(torch.randn(35, 13), 5, 2, 7, w, None)


class RowTowers(nn.Module):
    """N linears, each on its own piece of ``x.split(rows, dim)``: the rows of a batch cut into N parts."""

    def __init__(self, n=7, d_in=13, d_out=11, rows=5, dim=0, bias=True, used=None):
        super().__init__()
        self.rows, self.dim = rows, dim
        self.used = tuple(range(n)) if used is None else used
        self.towers = nn.ModuleList(nn.Linear(d_in, d_out, bias=bias) for _ in self.used)

    def forward(self, x):
        pieces = x.split(self.rows, self.dim)
        return [tower(pieces[i]) for i, tower in zip(self.used, self.towers)]


_DETAIL = ("7 x linear(13->11) on the pieces of 'split' -> 1 piecewise_batched_linear on 'x' (one baddbmm when all 7 "
           "pieces are whole, else one linear per piece)")
_ALL_SEVEN = ("towers_0", "towers_1", "towers_2", "towers_3", "towers_4", "towers_5", "towers_6")


@pytest.mark.parametrize("dtype,atol,rtol", _DTYPE_TOLERANCES)
@pytest.mark.parametrize("bias", [True, False])
def test_every_piece_of_an_int_split_with_a_last_piece_of_unknown_size_is_one_guarded_batched_linear(
        dtype, atol, rtol, bias):
    # fails where the rule cannot prove the last piece whole and leaves it apart (six of seven fused)
    model = randomize(RowTowers(bias=bias)).to(dtype)
    for rows in (7 * 5 - 2, 7 * 5):  # the last piece of 3 rows, or all whole
        gm, report = check_fusion(model, [torch.randn(rows, 13, dtype=dtype)], rules=["linear_batched"], atol=atol,
                                  rtol=rtol)
        assert [r.members for r in report.records] == [_ALL_SEVEN]
        assert report.records[0].detail == _DETAIL
        calls = count_calls(gm)
        assert calls["piecewise_batched_linear"] == 1 and "Linear" not in calls and "stack" not in calls
        weight = next(p for n, p in gm.named_parameters() if "weight" in n)
        assert weight.shape == (7, 11, 13) and len(list(gm.parameters())) == (2 if bias else 1)
        # the same fused graph on inputs whose last piece is whole, shorter, or followed by unused rows
        for other in (7 * 5, 6 * 5 + 1, 7 * 5 + 4):
            compare_with_model(model, gm, [torch.randn(other, 13, dtype=dtype)], atol=atol, rtol=rtol)
        with pytest.raises(IndexError):  # piece 6 does not exist: as in the unfused model
            gm(torch.randn(6 * 5, 13, dtype=dtype))


@pytest.mark.parametrize("dtype,atol,rtol", _DTYPE_TOLERANCES)
def test_example_inputs_settle_the_last_piece_without_a_guard(dtype, atol, rtol):
    model = randomize(RowTowers()).to(dtype)
    x = torch.randn(7 * 5, 13, dtype=dtype)
    gm, report = check_fusion(model, [x], rules=["linear_batched"], example_inputs=[x], atol=atol, rtol=rtol)
    assert [r.members for r in report.records] == [_ALL_SEVEN]
    assert count_calls(gm)["batched_linear"] == 1 and "piecewise_batched_linear" not in count_calls(gm)
    # a genuinely shorter last piece, with shapes known: it stays apart, exactly as computed before
    x = torch.randn(7 * 5 - 2, 13, dtype=dtype)
    gm, report = check_fusion(model, [x], rules=["linear_batched"], example_inputs=[x], atol=atol, rtol=rtol)
    assert [r.members for r in report.records] == [_ALL_SEVEN[:6]] and count_calls(gm)["Linear"] == 1


def test_a_split_along_a_middle_dim_is_guarded_too():
    model = randomize(RowTowers(dim=1))
    gm, report = check_fusion(model, [torch.randn(3, 7 * 5 - 2, 13)], rules=["linear_batched"])
    assert [r.members for r in report.records] == [_ALL_SEVEN] and "Linear" not in count_calls(gm)
    for width in (7 * 5, 7 * 5 + 3):
        compare_with_model(model, gm, [torch.randn(2, width, 13)])


def test_pieces_given_in_any_order_keep_their_own_weights():
    model = randomize(RowTowers(n=4, used=(2, 0, 3, 1)))
    gm, report = check_fusion(model, [torch.randn(4 * 5 - 1, 13)], rules=["linear_batched"])
    assert count_calls(gm)["piecewise_batched_linear"] == 1
    assert report.records[0].members == ("towers_1", "towers_3", "towers_0", "towers_2")  # by piece index


def test_a_possibly_shorter_piece_in_a_partial_group_stays_apart():
    # pieces 0, 2, 3 of four: not every piece, so piece 3 (maybe short) is neither guarded nor stacked
    model = randomize(RowTowers(n=4, used=(0, 2, 3)))
    gm, report = check_fusion(model, [torch.randn(4 * 5 - 1, 13)], rules=["linear_batched"])
    assert [r.members for r in report.records] == [("towers_0", "towers_1")]
    assert count_calls(gm)["Linear"] == 1 and count_calls(gm)["batched_linear"] == 1


def test_pieces_that_may_lie_along_the_feature_dim_are_not_joined_with_the_wrong_size():
    # x.split(13, 0) into Linear(13, 11): for a 1-d x, dim 0 is the feature dim and each result has 11
    # values, not 13, so the results cannot be cut from one joined tensor by 13: the last piece stays apart
    model = randomize(RowTowers(n=3, rows=13))
    gm, report = check_fusion(model, [torch.randn(3 * 13, 13)], rules=["linear_batched"])
    assert [r.members for r in report.records] == [("towers_0", "towers_1")]
    compare_with_model(model, gm, [torch.randn(3 * 13)])  # 1-d: three pieces of 13 features
    # with as many outputs as inputs, the cut is right either way: every piece is guarded
    model = randomize(RowTowers(n=3, rows=13, d_out=13))
    gm, report = check_fusion(model, [torch.randn(3 * 13 - 4, 13)], rules=["linear_batched"])
    assert len(report.records[0].members) == 3 and count_calls(gm)["piecewise_batched_linear"] == 1
    compare_with_model(model, gm, [torch.randn(3 * 13)])


class RowChain(nn.Module):
    """Per piece of ``x.split(5, 0)``: Linear -> LayerNorm -> tanh, and the results concatenated again."""

    def __init__(self, n=7):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(13, 11) for _ in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(11) for _ in range(n))

    def forward(self, x):
        pieces = x.split(5, 0)
        return torch.cat([torch.tanh(norm(lin(pieces[i])))
                          for i, (lin, norm) in enumerate(zip(self.linears, self.norms))], 0)


def test_the_rules_after_it_see_the_pieces_of_a_split_again():
    model = randomize(RowChain())
    gm, report = check_fusion(model, [torch.randn(7 * 5 - 2, 13)])
    assert all(len(r.members) == 7 for r in report.records if r.rule in ("linear_batched", "layer_norm"))
    calls = count_calls(gm)
    assert (calls["piecewise_batched_linear"], calls["piecewise_layer_norm"], calls["tanh"]) == (1, 1, 1)
    assert not {"Linear", "LayerNorm"} & set(calls)
    compare_with_model(model, gm, [torch.randn(7 * 5, 13)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_the_guarded_batched_linear_compiles_with_inductor_on_the_gpu(dtype, tol):
    """Inductor compiles the guard and both of its paths: the whole-pieces input and the shorter last piece."""
    model = randomize(RowTowers()).to("cuda", dtype)
    gm, _ = check_fusion(model, [torch.randn(35, 13, device="cuda", dtype=dtype)], rules=["linear_batched"],
                         atol=tol, rtol=tol)
    compiled = torch.compile(gm, dynamic=True)
    for rows in (35, 33, 39):
        x = torch.randn(rows, 13, device="cuda", dtype=dtype, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        out, ref = compiled(x), model(x_ref)
        for a, b in zip(out, ref):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        grad = [torch.randn_like(r) for r in ref]
        torch.autograd.backward(out, grad)
        torch.autograd.backward(ref, grad)
        torch.testing.assert_close(x.grad, x_ref.grad, atol=tol, rtol=tol)

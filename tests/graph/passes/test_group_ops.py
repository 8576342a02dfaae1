import pytest
import torch
import torch.nn.functional as F

from schedlang.graph.passes.group_ops import batched_linear, group_layer_norm, merge_group_dim


def _leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_(True)


@pytest.mark.parametrize("shape,group_dim,normalized", [
    ((7, 3, 13), -2, (13,)), ((3, 7, 13), 0, (13,)), ((2, 4, 5, 6), 1, (5, 6)), ((4, 2, 5, 6), -3, (5, 6))])
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
def test_group_layer_norm_matches_one_layer_norm_per_piece(shape, group_dim, normalized, affine):
    x = _leaf(*shape)
    n = shape[group_dim]
    w = _leaf(n, *normalized) if affine in ("both", "weight") else None
    b = _leaf(n, *normalized) if affine in ("both", "bias") else None
    out = group_layer_norm(x, normalized, w, b, 1e-5, group_dim)
    expected = torch.stack([F.layer_norm(x.select(group_dim, i), normalized, None if w is None else w[i],
                                         None if b is None else b[i], 1e-5) for i in range(n)], group_dim)
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)
    leaves = [t for t in (x, w, b) if t is not None]
    got = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(expected, leaves, g)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


def test_group_layer_norm_rounds_bfloat16_once_like_layer_norm():
    x = torch.randn(64, 50, 64, dtype=torch.bfloat16)
    w = (torch.randn(50, 64) * 0.5 + 1).bfloat16()
    b = (torch.randn(50, 64) * 0.5 + 1).bfloat16()
    out = group_layer_norm(x, (64,), w, b, 1e-5, -2)
    assert out.dtype == torch.bfloat16
    expected = torch.stack([F.layer_norm(x[:, i], (64,), w[i], b[i]) for i in range(50)], 1)
    # at most one unit in the last place apart (rounding the normalized values to bfloat16 before
    # the affine step would be up to four)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=2 ** -6)


def test_group_layer_norm_keeps_the_input_dtype_with_float32_parameters():
    x = torch.randn(5, 3, 8, dtype=torch.bfloat16)
    w, b = torch.randn(3, 8), torch.randn(3, 8)
    out = group_layer_norm(x, (8,), w, b, 1e-5, -2)
    assert out.dtype == torch.bfloat16
    expected = torch.stack([F.layer_norm(x[:, i].float(), (8,), w[i], b[i]) for i in range(3)], 1)
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -7, atol=2 ** -6)


@pytest.mark.parametrize("shape,group_dim", [((4, 7, 5), 0), ((7, 4, 5), -2), ((2, 7, 4, 5), -2), ((4, 5), 0)])
@pytest.mark.parametrize("bias", [True, False])
def test_batched_linear_matches_one_linear_per_piece(shape, group_dim, bias):
    x = _leaf(*shape)
    n = shape[group_dim]
    w = _leaf(n, 3, shape[-1])
    b = _leaf(n, 3) if bias else None
    out = batched_linear(x, w, b, group_dim)
    expected = torch.stack([F.linear(x.select(group_dim, i), w[i], None if b is None else b[i]) for i in range(n)],
                           group_dim)
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)
    leaves = [t for t in (x, w, b) if t is not None]
    for a, e in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(expected, leaves, g)):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("shape,group_dim,dim", [((4, 3, 5), 1, -1), ((4, 3, 5), -2, 0), ((3, 4, 5), 0, 1),
                                                 ((2, 3, 4, 5), -1, 1)])
def test_merge_group_dim_is_cat_of_the_pieces(shape, group_dim, dim):
    x = torch.randn(*shape)
    torch.testing.assert_close(merge_group_dim(x, group_dim, dim), torch.cat(x.unbind(group_dim), dim))


# ------------------------------------------------------------------ ops on an int split's pieces, guarded
from schedlang.graph.passes import group_ops  # noqa: E402
from schedlang.graph.passes.group_ops import piecewise_layer_norm, span_of_pieces  # noqa: E402

_TOLERANCES = {torch.float32: (1e-5, 1.3e-6), torch.bfloat16: (3e-2, 1.6e-2), torch.float16: (5e-3, 1e-3)}


def _per_piece_layer_norm(x, size, dim, count, normalized, w, b):
    """What the unfused graph computes: one layer norm per piece, in a list."""
    pieces = x.split(size, dim)
    return [F.layer_norm(pieces[i], normalized, None if w is None else w[i], None if b is None else b[i], 1e-5)
            for i in range(count)]


@pytest.mark.parametrize("length,expect_grouped", [(7 * 13, True), (7 * 13 - 5, False), (7 * 13 + 5, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_piecewise_layer_norm_is_one_layer_norm_per_piece_whatever_the_length(length, expect_grouped, dtype,
                                                                              monkeypatch):
    calls = []
    grouped = group_ops.group_layer_norm
    monkeypatch.setattr(group_ops, "group_layer_norm", lambda *a: calls.append(1) or grouped(*a))
    x = _leaf(4, length, 6, dtype=dtype)
    w, b = _leaf(7, 6, dtype=dtype), _leaf(7, 6, dtype=dtype)
    out = piecewise_layer_norm(x, 13, 1, 7, (6,), w, b, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype and len(calls) == int(expect_grouped)
    expected = _per_piece_layer_norm(x, 13, 1, 7, (6,), w, b)
    atol, rtol = _TOLERANCES[dtype]
    got = list(out.split(13, 1)[:7])
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol)
    if length > 7 * 13:  # the part after the pieces passes through
        torch.testing.assert_close(out[:, 91:], x[:, 91:], atol=0, rtol=0)
    gs = [torch.randn_like(e) for e in expected]
    for a, e in zip(torch.autograd.grad(got, (x, w, b), gs), torch.autograd.grad(expected, (x, w, b), gs)):
        torch.testing.assert_close(a, e, atol=atol * max(1.0, e.abs().max().item()), rtol=rtol)


@pytest.mark.parametrize("shape,dim,normalized,grouped", [
    ((5, 7 * 13), 1, (13,), True),        # the split dim is the normalized one
    ((5, 7 * 13), -1, (13,), True),
    ((3, 7 * 4, 2, 5), 1, (2, 5), True),  # normalized dims after the split dim
    ((3, 2, 7 * 4), -1, (2, 4), False)])  # the split dim inside the normalized dims: per piece
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_piecewise_layer_norm_groups_only_when_the_layout_allows(shape, dim, normalized, grouped, affine,
                                                                 monkeypatch):
    calls = []
    original = group_ops.group_layer_norm
    monkeypatch.setattr(group_ops, "group_layer_norm", lambda *a: calls.append(1) or original(*a))
    size = shape[dim] // 7
    x = _leaf(*shape)
    w = _leaf(7, *normalized) if affine != "none" else None
    b = _leaf(7, *normalized) if affine == "both" else None
    out = piecewise_layer_norm(x, size, dim, 7, normalized, w, b, 1e-5)
    assert len(calls) == int(grouped)
    torch.testing.assert_close(out, torch.cat(_per_piece_layer_norm(x, size, dim, 7, normalized, w, b), dim))


def test_piecewise_layer_norm_raises_like_the_split_when_a_piece_is_missing():
    x = torch.randn(3, 6 * 13)
    with pytest.raises(IndexError):
        piecewise_layer_norm(x, 13, 1, 7, (13,), None, None, 1e-5)  # piece 6 does not exist
    with pytest.raises(IndexError, match="Dimension out of range"):
        piecewise_layer_norm(x, 13, 2, 7, (13,), None, None, 1e-5)


@pytest.mark.parametrize("length", [91, 86, 79, 96])
@pytest.mark.parametrize("start_piece", [0, 2])
def test_span_of_pieces_is_the_cat_of_the_pieces(length, start_piece):
    x = torch.randn(4, length, requires_grad=True)
    pieces = x.split(13, 1)
    expected = torch.cat(pieces[start_piece:7], 1)
    out = span_of_pieces(x, 1, start_piece * 13, 91, 13)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    if start_piece == 0 and length <= 91:
        assert out is x  # every piece whole or the last one short: no copy at all
    g = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(expected, x, g)[0])


def test_span_of_pieces_raises_when_its_last_piece_does_not_exist():
    with pytest.raises(IndexError, match=r"^piece 6 of a split into pieces of 13 along dim -1 does not exist: the "
                                         r"tensor has 78 there$"):
        span_of_pieces(torch.randn(2, 78), -1, 0, 91, 13)

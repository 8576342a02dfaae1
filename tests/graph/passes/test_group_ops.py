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

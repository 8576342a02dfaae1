"""Generated Triton kernels for subgraphs that reduce over the last dimension (LayerNorm,
RMSNorm, softmax, sum/mean/amax), forward and backward, including weight and bias
gradients summed over rows."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from .utils import check_fused

SHAPES = [(7, 13), (3, 5, 1000), (1, 1)]
DTYPES = [torch.float32, torch.bfloat16]
ids = lambda s: "x".join(map(str, s))  # noqa: E731


def _randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


class BiasDropoutResidualLayerNorm(nn.Module):
    """The post-attention block of BERT/GPT-2: LayerNorm(dropout(x + bias) + residual)."""

    def __init__(self, hidden, p):
        super().__init__()
        self.dropout = nn.Dropout(p)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x, bias, residual):
        return self.norm(self.dropout(x + bias) + residual)


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p, train", [(0.0, True), (0.1, False)], ids=["p0-train", "p0.1-eval"])
def test_bias_dropout_residual_layer_norm(shape, dtype, p, train):
    n = shape[-1]
    block = _randomize(BiasDropoutResidualLayerNorm(n, p)).to(dtype)
    fused = check_fused(block, [torch.randn(shape, dtype=dtype), torch.randn(n, dtype=dtype),
                                torch.randn(shape, dtype=dtype)], name="BiasDropResLN", train=train)
    assert sorted(dict(fused.named_parameters())) == ["norm.bias", "norm.weight"]


@pytest.mark.parametrize("affine", [True, False])
def test_functional_layer_norm(affine):
    def ln(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w if affine else None, b if affine else None, eps=1e-6)

    gm = torch.fx.symbolic_trace(ln, concrete_args=None)
    check_fused(gm, [torch.randn(3, 5, 40), torch.randn(40), torch.randn(40)])


def test_layer_norm_module_without_affine_and_bias_only_variants():
    check_fused(nn.LayerNorm(13, elementwise_affine=False), [torch.randn(7, 13)])
    check_fused(_randomize(nn.LayerNorm(13, bias=False)), [torch.randn(7, 13)])


def _llama_rms_norm(x, weight):
    # LlamaRMSNorm written out: float32 statistics, cast back, then the weight
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + 1e-6)
    return weight * h.to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_chain(shape, dtype):
    gm = torch.fx.symbolic_trace(_llama_rms_norm, concrete_args=None)
    check_fused(gm, [torch.randn(shape, dtype=dtype), torch.randn(shape[-1], dtype=dtype)], name="RMSNorm")


def test_residual_add_then_rms_norm_two_outputs():
    def add_rms(x, residual, w):
        h = x + residual
        return _llama_rms_norm(h, w), h

    check_fused(add_rms, [torch.randn(3, 5, 64), torch.randn(3, 5, 64), torch.randn(64)])


@pytest.mark.skipif(not hasattr(nn, "RMSNorm"), reason="nn.RMSNorm needs torch >= 2.4")
def test_rms_norm_module_and_functional():
    check_fused(_randomize(nn.RMSNorm(13, eps=1e-5)), [torch.randn(7, 13)])
    check_fused(lambda x, w: F.rms_norm(x, (13,), w), [torch.randn(7, 13), torch.randn(13)])


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax(shape, dtype):
    check_fused(lambda x: F.softmax(x, dim=-1), [torch.randn(shape, dtype=dtype) * 4])


def test_softmax_variants():
    # positive last-dim index, method form, nn.Softmax, log_softmax, softmax with a dtype
    check_fused(lambda x: torch.softmax(x, 1) + x.softmax(-1) * 2, [torch.randn(7, 13)])
    check_fused(nn.Softmax(dim=-1), [torch.randn(7, 13)])
    check_fused(lambda x: F.log_softmax(x * 3, dim=-1), [torch.randn(7, 13)])
    check_fused(lambda x: F.softmax(x, dim=-1, dtype=torch.float32), [torch.randn(7, 13, dtype=torch.bfloat16)])


def test_scaled_masked_softmax():
    # attention-score style: scale, additive mask broadcast over rows, softmax
    check_fused(lambda s, mask: F.softmax(s * 0.125 + mask, dim=-1), [torch.randn(2, 3, 5, 17),
                                                                      torch.randn(17)])


def test_sum_and_mean_keepdim_and_not():
    def fn(x):
        return x.sum(-1, keepdim=True) * x, x.mean(dim=-1), torch.sum(x * x, -1), torch.mean(x, (-1,), True)

    check_fused(fn, [torch.randn(3, 5, 13)])


def test_amax_and_centering():
    check_fused(lambda x: (torch.amax(x, -1, keepdim=True), x - x.mean(-1, keepdim=True)), [torch.randn(7, 13)])


def test_reduction_undone_by_unsqueeze():
    check_fused(lambda x: x * x.sum(-1).unsqueeze(-1), [torch.randn(7, 13)])


def test_long_rows():
    # a row of 5000 columns in one tile (BLOCK_N = 8192)
    check_fused(lambda x, w: F.layer_norm(x, (5000,), w), [torch.randn(3, 5000), torch.randn(5000)])

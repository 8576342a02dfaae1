"""Dropout inside generated kernels: Philox masks drawn in the forward kernel and
regenerated (not saved) in the backward kernel."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from schedlang.lowering import lower_subgraph

from .utils import DEVICE


class BiasDropoutResidual(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.dropout = nn.Dropout(p)

    def forward(self, x, bias, residual):
        return self.dropout(x + bias) + residual


def _inputs():
    return [torch.randn(64, 100, device=DEVICE, requires_grad=True),
            torch.randn(100, device=DEVICE, requires_grad=True),
            torch.randn(64, 100, device=DEVICE, requires_grad=True)]


def test_training_mask_statistics_scaling_and_backward():
    fused = lower_subgraph(torch.fx.symbolic_trace(BiasDropoutResidual(0.3)), "triton", "BiasDropRes").train()
    x, bias, residual = _inputs()
    y = fused(x, bias, residual)
    kept = (y - residual).abs() > 1e-6
    # 6400 Bernoulli(0.7) draws: the kept fraction is within 0.05 of 0.7 with overwhelming probability
    assert abs(kept.float().mean().item() - 0.7) < 0.05
    torch.testing.assert_close((y - residual)[kept], ((x + bias) / 0.7)[kept])
    assert len(y.grad_fn.saved_tensors) == 0  # the mask is regenerated, not saved
    g = torch.randn_like(y)
    y.backward(g)
    expected = torch.where(kept, g / 0.7, torch.zeros_like(g))  # the same mask, regenerated
    torch.testing.assert_close(x.grad, expected)
    torch.testing.assert_close(bias.grad, expected.sum(0), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(residual.grad, g)


def test_masks_differ_between_calls_and_follow_the_torch_seed():
    fused = lower_subgraph(torch.fx.symbolic_trace(BiasDropoutResidual(0.5)), "triton", "BiasDropRes").train()
    x, bias, residual = _inputs()
    with torch.no_grad():
        first, second = fused(x, bias, residual), fused(x, bias, residual)
        assert not torch.equal(first, second)
        torch.manual_seed(123)
        again = fused(x, bias, residual)
        torch.manual_seed(123)
        torch.testing.assert_close(fused(x, bias, residual), again, rtol=0, atol=0)


def test_eval_mode_is_identity_and_a_separate_specialization():
    gm = torch.fx.symbolic_trace(BiasDropoutResidual(0.3))
    fused = lower_subgraph(gm, "triton", "BiasDropRes")
    x, bias, residual = _inputs()
    fused.train()(x, bias, residual)
    assert "tl.rand" in fused.source
    torch.testing.assert_close(fused.eval()(x, bias, residual), x + bias + residual)
    assert "tl.rand" not in fused.source
    assert len(fused.specializations) == 2


def test_functional_dropout_and_p_edge_cases():
    x = torch.randn(32, 50, device=DEVICE, requires_grad=True)
    half = lower_subgraph(torch.fx.symbolic_trace(lambda x: F.dropout(x, 0.5, True)), "triton", "Drop")
    assert abs((half(x) == 0).float().mean().item() - 0.5) < 0.06
    off = lower_subgraph(torch.fx.symbolic_trace(lambda x: F.dropout(x, 0.5, False) * 2), "triton", "NoDrop")
    torch.testing.assert_close(off(x), x * 2)
    everything = lower_subgraph(torch.fx.symbolic_trace(lambda x: F.dropout(x, 1.0, True) + 1), "triton", "All")
    torch.testing.assert_close(everything(x), torch.ones_like(x))
    # folded to a constant, still broadcast to the input's shape (and a zero gradient)
    zero = lower_subgraph(torch.fx.symbolic_trace(lambda x: x * 0.0), "triton", "Zero")
    y = zero(x)
    assert y.shape == x.shape and not y.any()
    (grad,) = torch.autograd.grad(y.sum(), x, allow_unused=True)
    assert grad is None or not grad.any()

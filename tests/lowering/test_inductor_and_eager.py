"""The two compilers that take any PyTorch op: torch.compile and plain eager."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from .utils import check_fused


class BiasDropoutResidualLayerNorm(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x, bias, residual):
        return self.norm(self.dropout(x + bias) + residual)


def test_eager_forward_and_backward():
    check_fused(BiasDropoutResidualLayerNorm(13), [torch.randn(7, 13), torch.randn(13), torch.randn(7, 13)],
                compiler="eager", name="BiasDropResLN")


def test_eager_takes_ops_triton_does_not():
    check_fused(lambda x, w: torch.cumsum(x @ w, 0), [torch.randn(5, 7), torch.randn(7, 3)], compiler="eager")


def test_inductor_forward_and_backward():
    # one compile (forward and backward) for the whole file: compiling takes seconds on CPU
    fused = check_fused(lambda x, b, w: F.layer_norm(F.gelu(x + b, approximate="tanh"), (13,), w),
                        [torch.randn(7, 13), torch.randn(13), torch.randn(13)], compiler="inductor",
                        name="BiasGeLULN")
    assert fused.source.startswith("# compiled by torch.compile(fullgraph=True)")

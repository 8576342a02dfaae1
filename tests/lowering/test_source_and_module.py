"""What a fused module shows and owns: generated source, repr, parameters under their
original names, copies, dtype changes."""

import ast
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp

from schedlang.lowering import lower_subgraph

from .utils import DEVICE


def _bias_gelu(x, bias):
    return F.gelu(x + bias, approximate="tanh")


class BiasResidualLayerNorm(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)

    def forward(self, x, bias, residual):
        return self.ln(x + bias + residual)


def test_source_holds_forward_and_backward_kernels():
    gm = torch.fx.symbolic_trace(_bias_gelu)
    x, bias = torch.randn(8, 64, device=DEVICE), torch.randn(64, device=DEVICE)
    fused = lower_subgraph(gm, "triton", "BiasGeLU", example_inputs=[x, bias])
    source = fused.source
    ast.parse(source)  # a complete Python module
    assert source.count("@triton.jit") >= 3  # helpers, forward, backward
    assert "def bias_gelu_fwd_kernel(" in source and "def bias_gelu_bwd_kernel(" in source
    assert "    gelu = F.gelu(add, approximate='tanh')" in source  # the subgraph, in the module docstring
    assert "# add = operator.add(x, bias)" in source  # each node's lines are labelled
    assert "Recomputes the forward from x, bias (nothing else is saved)" in source
    assert "per-program column sums" in source  # the bias gradient
    # the text shown is the text that runs
    y = fused(x.requires_grad_(), bias)
    assert fused.source == source
    y.sum().backward()


def test_source_before_and_after_the_first_call():
    gm = torch.fx.symbolic_trace(_bias_gelu)
    fused = lower_subgraph(gm, "triton", "BiasGeLU")
    assert fused.source.startswith("# 'BiasGeLU': kernels are generated for the input shapes at the first call")
    fused(torch.randn(4, 8, device=DEVICE), torch.randn(8, device=DEVICE))
    assert "def bias_gelu_fwd_kernel(" in fused.source


def test_shapes_recorded_in_the_graph_are_used_up_front():
    gm = torch.fx.symbolic_trace(_bias_gelu)
    ShapeProp(gm).propagate(torch.randn(4, 8), torch.randn(8))
    fused = lower_subgraph(gm, "triton", "BiasGeLU")
    assert "def bias_gelu_fwd_kernel(" in fused.source
    assert "Inputs x: (4, 8) float32, bias: (8,) float32" in fused.source


def test_repr_names_the_module_and_its_operations():
    block = BiasResidualLayerNorm()
    gm = torch.fx.symbolic_trace(block)
    fused = lower_subgraph(gm, "triton", "BiasResLN")
    text = repr(fused)
    assert text.startswith("BiasResLN(\n  compiler='triton', inputs=(x, bias, residual), outputs=(ln,)\n")
    assert "    add = operator.add(x, bias)\n" in text
    assert "    ln = self.ln(add_1)  # nn.LayerNorm\n" in text
    assert "  (ln): LayerNorm((16,), eps=1e-05" in text
    assert fused._get_name() == "BiasResLN"


def test_parameters_keep_their_names_and_identity():
    gm = torch.fx.symbolic_trace(BiasResidualLayerNorm())
    for compiler in ("triton", "eager", "inductor"):
        fused = lower_subgraph(gm, compiler, "BiasResLN")
        assert list(fused.state_dict()) == ["ln.weight", "ln.bias"]
        assert fused.ln.weight is gm.ln.weight


def test_deepcopy_copies_parameters_and_shares_kernels():
    gm = torch.fx.symbolic_trace(BiasResidualLayerNorm())
    fused = lower_subgraph(gm, "triton", "BiasResLN").to(DEVICE)
    x, b, r = (torch.randn(4, 16, device=DEVICE), torch.randn(16, device=DEVICE), torch.randn(4, 16, device=DEVICE))
    y = fused(x, b, r)
    clone = copy.deepcopy(fused)
    assert clone.ln.weight is not fused.ln.weight
    torch.testing.assert_close(clone(x, b, r), y)
    with torch.no_grad():
        clone.ln.weight.mul_(2)  # the copy reads its own weights
    torch.testing.assert_close(clone(x, b, r), gm.to(DEVICE)(x, b, r) * 2 - gm.ln.bias * 1)
    assert clone.specializations == fused.specializations


def test_changing_the_module_dtype_respecializes():
    gm = torch.fx.symbolic_trace(BiasResidualLayerNorm())
    fused = lower_subgraph(gm, "triton", "BiasResLN").to(DEVICE)
    x, b, r = (torch.randn(4, 16, device=DEVICE), torch.randn(16, device=DEVICE), torch.randn(4, 16, device=DEVICE))
    fused(x, b, r)
    fused.to(torch.float64)
    y = fused(x.double(), b.double(), r.double())
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, gm(x.double(), b.double(), r.double()))
    assert len(fused.specializations) == 2

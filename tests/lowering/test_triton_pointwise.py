"""Generated Triton kernels for pointwise subgraphs: outputs and gradients (inputs, biases,
scalars) against PyTorch, with broadcasting, dtype promotion and irregular shapes."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from .utils import DEVICE, check_fused

SHAPES = [(7, 13), (3, 5, 1000), (1, 1)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu(shape, dtype, approximate):
    def bias_gelu(x, bias):
        return F.gelu(x + bias, approximate=approximate)

    x = torch.randn(shape, dtype=dtype)
    bias = torch.randn(shape[-1], dtype=dtype)
    check_fused(bias_gelu, [x, bias], name="BiasGeLU")


@pytest.mark.parametrize("module", [nn.GELU(approximate="tanh"), nn.GELU(), nn.SiLU(), nn.ReLU(), nn.Tanh(),
                                    nn.Sigmoid()], ids=lambda m: repr(m))
def test_activation_modules_after_bias(module):
    class BiasAct(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = module

        def forward(self, x, bias):
            return self.act(x + bias)

    check_fused(BiasAct(), [torch.randn(7, 13), torch.randn(13)])


def test_functional_activations_and_math():
    def fn(x, y):
        return (F.silu(x) + F.relu(y) * torch.sigmoid(x) - torch.tanh(y) + torch.erf(x) * torch.exp(-y * y)
                + torch.log(x.abs() + 1.0) + torch.sqrt(y * y + 1.0) + torch.rsqrt(x * x + 2.0) - torch.neg(x).abs())

    check_fused(fn, [torch.randn(7, 13), torch.randn(7, 13)])


def test_python_scalars_and_powers():
    def fn(x):
        return (2.5 * x - 1) / 3 + 2 ** x + x.pow(3) - x ** 2 + 1 / (x * x + 1) + x.square() - torch.reciprocal(x + 4)

    check_fused(fn, [torch.rand(7, 13) + 0.1])


def test_tensor_power_and_fractional_exponent():
    check_fused(lambda x, y: x ** y + x ** 0.5 + x ** -1.5, [torch.rand(7, 13) + 0.5, torch.randn(7, 13)])


def test_zero_dim_and_row_inputs():
    # a 0-d scale, a per-row (M, 1) shift and a (1, 1) scalar tensor
    check_fused(lambda x, s, r, t: torch.tanh(x * s) + r * t, [torch.randn(7, 13), torch.randn(()),
                                                              torch.randn(7, 1), torch.randn(1, 1)])


def test_partially_broadcast_input():
    # (1, T, N) against (B, T, N): expanded on the host, its gradient summed back
    check_fused(lambda x, pos: x * 2 + pos * x, [torch.randn(2, 3, 8), torch.randn(1, 3, 8)])


def test_row_and_column_inputs_only():
    # (M, 1) op (N,) -> (M, N): neither input spans the grid
    check_fused(lambda r, c: torch.sigmoid(r * c) + c, [torch.randn(5, 1), torch.randn(9)])


def test_dtype_promotion_mixed_inputs():
    # bf16 activations with an fp32 bias: PyTorch promotes to fp32
    check_fused(lambda x, b: F.gelu(x + b), [torch.randn(7, 13, dtype=torch.bfloat16), torch.randn(13)])
    # fp16 in, explicit float() and back to half
    check_fused(lambda x, b: (F.silu(x.float()) * b).half(), [torch.randn(7, 13, dtype=torch.float16),
                                                              torch.randn(13)])


def test_explicit_cast_rounds_like_pytorch():
    from schedlang.lowering import lower_subgraph

    gm = torch.fx.symbolic_trace(lambda x: (x * 3).to(torch.bfloat16).float() * 7)
    x = torch.randn(7, 13, device=DEVICE)
    fused = lower_subgraph(gm, "triton", "Rounding")
    # one rounding to bf16 in the middle, as in PyTorch: bit-exact in fp32 arithmetic
    torch.testing.assert_close(fused(x), gm(x), rtol=0, atol=0)


def test_float64():
    check_fused(lambda x, b: F.gelu(x + b) * torch.sigmoid(b), [torch.randn(7, 13, dtype=torch.float64),
                                                                torch.randn(13, dtype=torch.float64)])


def test_clamp_where_comparisons_max_min():
    def fn(x, y):
        return (torch.clamp(x, -0.5, 0.7) + torch.where(x > y, x, y * 0.1) + torch.maximum(x, y)
                - torch.minimum(x, 2 * y) + x.clamp(min=0.1))

    check_fused(fn, [torch.randn(7, 13), torch.randn(7, 13)])


def test_multiple_outputs_with_duplicates_and_passthrough():
    def fn(x, bias):
        y = x + bias
        return F.gelu(y), y, y, x

    check_fused(fn, [torch.randn(7, 13), torch.randn(13)])


def test_outputs_computed_from_weights_only():
    # a column output and a scalar output: written once, gradient counted once
    check_fused(lambda x, w: (x * w, w * 2, (w * w).sum(-1)), [torch.randn(5, 6), torch.randn(6)])


def test_non_contiguous_input_and_expanded_gradient():
    from schedlang.lowering import lower_subgraph

    gm = torch.fx.symbolic_trace(lambda x, b: F.gelu(x + b))
    fused = lower_subgraph(gm, "triton", "BiasGeLU")
    base = torch.randn(13, 7, device=DEVICE).t()  # (7, 13), column-major
    x = base.requires_grad_()
    b = torch.randn(13, device=DEVICE, requires_grad=True)
    fused(x, b).sum().backward()  # the incoming gradient is an expanded (stride 0) tensor
    x_ref, b_ref = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    gm(x_ref, b_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(b.grad, b_ref.grad)


def test_gradient_of_one_output_only():
    from schedlang.lowering import lower_subgraph

    gm = torch.fx.symbolic_trace(lambda x, b: (torch.tanh(x + b), torch.sigmoid(x) * b))
    fused = lower_subgraph(gm, "triton", "TwoOut")
    x = torch.randn(7, 13, device=DEVICE, requires_grad=True)
    b = torch.randn(13, device=DEVICE, requires_grad=True)
    g = torch.randn(7, 13, device=DEVICE)
    got = torch.autograd.grad(fused(x, b)[1], (x, b), g)
    want = torch.autograd.grad(gm(x, b)[1], (x, b), g)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w)


def test_only_some_inputs_require_grad():
    from schedlang.lowering import lower_subgraph

    gm = torch.fx.symbolic_trace(lambda x, b: F.gelu(x * b))
    fused = lower_subgraph(gm, "triton", "ScaleGeLU")
    x = torch.randn(7, 13, device=DEVICE, requires_grad=True)
    b = torch.randn(13, device=DEVICE)  # frozen
    y = fused(x, b)
    g = torch.randn_like(y)
    (got,) = torch.autograd.grad(y, (x,), g)
    (want,) = torch.autograd.grad(gm(x, b), (x,), g)
    torch.testing.assert_close(got, want)


def test_backward_saves_only_what_it_reads():
    from schedlang.lowering import lower_subgraph

    x = torch.randn(7, 13, device=DEVICE, requires_grad=True)
    b = torch.randn(13, device=DEVICE, requires_grad=True)
    r = torch.randn(7, 13, device=DEVICE, requires_grad=True)
    # d(x + b + r) needs no forward value at all
    add3 = lower_subgraph(torch.fx.symbolic_trace(lambda x, b, r: x + b + r), "triton", "Add3")
    y = add3(x, b, r)
    assert len(y.grad_fn.saved_tensors) == 0
    # gelu'(x + b) reads x and b again (recomputed), never the output
    bias_gelu = lower_subgraph(torch.fx.symbolic_trace(lambda x, b, r: F.gelu(x + b) + r), "triton", "BG")
    y = bias_gelu(x, b, r)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 2 and saved[0] is x and saved[1] is b


def test_no_grad_forward_matches():
    from schedlang.lowering import lower_subgraph

    gm = torch.fx.symbolic_trace(lambda x, b: F.gelu(x + b))
    fused = lower_subgraph(gm, "triton", "BiasGeLU")
    x, b = torch.randn(3, 5, 1000, device=DEVICE), torch.randn(1000, device=DEVICE)
    with torch.no_grad():
        y = fused(x, b)
    assert not y.requires_grad
    torch.testing.assert_close(y, gm(x, b))


def test_shapes_seen_are_specialized_separately():
    from schedlang.lowering import lower_subgraph

    gm = torch.fx.symbolic_trace(lambda x, b: torch.tanh(x + b))
    fused = lower_subgraph(gm, "triton", "BiasTanh")
    for shape in [(7, 13), (4, 13), (2, 3, 13)]:
        x, b = torch.randn(shape, device=DEVICE), torch.randn(13, device=DEVICE)
        torch.testing.assert_close(fused(x, b), gm(x, b))
    assert fused.specializations == [(((7, 13), torch.float32), ((13,), torch.float32)),
                                     (((4, 13), torch.float32), ((13,), torch.float32)),
                                     (((2, 3, 13), torch.float32), ((13,), torch.float32))]


def test_inputs_with_the_same_gradient_share_one_tensor():
    from schedlang.lowering import lower_subgraph

    gm = torch.fx.symbolic_trace(lambda x, b, r: F.layer_norm(x + b + r, (13,)))
    fused = lower_subgraph(gm, "triton", "AddNorm")
    x, r = (torch.randn(7, 13, device=DEVICE, requires_grad=True) for _ in range(2))
    b = torch.randn(13, device=DEVICE, requires_grad=True)
    g = torch.randn(7, 13, device=DEVICE)
    gx, gb, gr = torch.autograd.grad(fused(x, b, r), (x, b, r), g)
    assert gx.data_ptr() == gr.data_ptr()  # written once
    want = torch.autograd.grad(gm(x, b, r), (x, b, r), g)
    for got, expected in zip((gx, gb, gr), want):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected)


def test_defaulted_non_tensor_argument():
    from schedlang.lowering import lower_subgraph

    def bias_gelu(x, bias, approximate="tanh"):  # traced: `approximate` becomes a placeholder with a default
        return F.gelu(x + bias, approximate=approximate)

    gm = torch.fx.symbolic_trace(bias_gelu)
    x, b = torch.randn(7, 13, device=DEVICE), torch.randn(13, device=DEVICE)
    fused = lower_subgraph(gm, "triton", "BiasGeLU", example_inputs=[x, b])
    torch.testing.assert_close(fused(x, b), F.gelu(x + b, approximate="tanh"))

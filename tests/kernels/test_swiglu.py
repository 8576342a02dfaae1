"""swiglu (Triton, interpreted on CPU) against silu(gate) * up, outputs and gradients."""

import pytest
import torch
import torch.nn.functional as F

from schedlang.errors import SchedlangError, ScheduleValueError
from schedlang.kernels import swiglu
from schedlang.kernels.swiglu import reference
from tests.kernels.numerics import assert_close_scaled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 13), (1000,), (3, 5, 100)])
def test_matches_reference(shape, dtype):
    gate, up = (3 * torch.randn(shape)).to(dtype), torch.randn(shape).to(dtype)
    g1, u1 = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    g2, u2 = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    out, ref = swiglu(g1, u1), reference(g2, u2)
    cot = torch.randn(shape).to(dtype)
    out.backward(cot)
    ref.backward(cot)
    assert out.dtype == dtype and g1.grad.dtype == dtype
    assert_close_scaled(out, ref, dtype, "output")
    assert_close_scaled(g1.grad, g2.grad, dtype, "grad gate")
    assert_close_scaled(u1.grad, u2.grad, dtype, "grad up")


def test_non_contiguous_inputs_and_hf_activation():
    from transformers.activations import ACT2FN

    gate_up = torch.randn(13, 2 * 96, requires_grad=True)
    gate, up = gate_up[:, :96], gate_up[:, 96:]  # views of one fused projection
    out = swiglu(gate, up)
    out.backward(torch.ones_like(out))
    leaf = gate_up.detach().clone().requires_grad_(True)
    ref = ACT2FN["silu"](leaf[:, :96]) * leaf[:, 96:]
    ref.backward(torch.ones_like(ref))
    assert_close_scaled(out, ref, torch.float32, "output")
    assert_close_scaled(gate_up.grad, leaf.grad, torch.float32, "grad")


def test_shapes_must_agree():
    with pytest.raises(SchedlangError, match=r"gate \(7, 13\) torch.float32 and up \(7, 12\) torch.float32 must "
                                             r"have the same shape and dtype"):
        swiglu(torch.randn(7, 13), torch.randn(7, 12))


def test_inputs_must_be_floating_point_tensors():
    with pytest.raises(ScheduleValueError, match=r"swiglu: gate must be a torch.Tensor, got list"):
        swiglu([1.0], [2.0])
    with pytest.raises(ScheduleValueError, match=r"swiglu: gate has dtype torch.int64: expected one of float32, "
                                                 r"bfloat16, float16, float64"):
        swiglu(torch.ones(4, 8, dtype=torch.long), torch.ones(4, 8, dtype=torch.long))


@pytest.mark.gpu
def test_llama_mlp_size_on_gpu():
    gate, up = torch.randn(4 * 2048, 5632).bfloat16(), torch.randn(4 * 2048, 5632).bfloat16()
    g1, u1 = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    g2, u2 = gate.float().requires_grad_(True), up.float().requires_grad_(True)
    out, ref = swiglu(g1, u1), F.silu(g2) * u2
    cot = torch.randn_like(ref)
    out.backward(cot.bfloat16())
    ref.backward(cot.bfloat16().float())
    assert_close_scaled(out, ref, torch.bfloat16, "output")
    assert_close_scaled(g1.grad, g2.grad, torch.bfloat16, "grad gate")
    assert_close_scaled(u1.grad, u2.grad, torch.bfloat16, "grad up")

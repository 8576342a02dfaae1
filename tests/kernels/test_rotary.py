"""apply_rotary (Triton, interpreted on CPU) against its reference and HF's apply_rotary_pos_emb."""

import pytest
import torch

from schedlang.errors import SchedlangError, ScheduleValueError
from schedlang.kernels import apply_rotary
from schedlang.kernels.rotary import reference
from tests.kernels.numerics import assert_close_scaled


def _cos_sin(batch, seq, dim, dtype, shared_halves=True):
    """cos / sin of random angles. ``shared_halves``: HF's layout, where the two halves of D hold the same
    frequencies; otherwise every column has its own angle, so a kernel that read the first half's cos or sin
    where the second half's belongs (or the other way round) gives a different answer from the reference."""
    if not shared_halves:
        angles = torch.randn(batch, seq, dim) * 3
        return angles.cos().to(dtype), angles.sin().to(dtype)
    angles = torch.randn(batch, seq, dim // 2) * 3
    angles = torch.cat([angles, angles], dim=-1)  # HF's layout: the two halves share frequencies
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,hq,hk,s,d,cos_batch,shared_halves", [
    (2, 4, 2, 7, 64, 2, False), (1, 3, 3, 13, 96, 1, True), (2, 2, 1, 100, 100, 1, False)])
def test_matches_reference(b, hq, hk, s, d, cos_batch, shared_halves, dtype):
    # q in HF's layout: projected as (B, S, H, D) and transposed to (B, H, S, D), a view
    q = torch.randn(b, s, hq, d).to(dtype).transpose(1, 2)
    k = torch.randn(b, hk, s, d).to(dtype)
    cos, sin = _cos_sin(cos_batch, s, d, dtype, shared_halves)
    q1, k1 = q.detach().clone().requires_grad_(True), k.clone().requires_grad_(True)
    q2, k2 = q.detach().clone().requires_grad_(True), k.clone().requires_grad_(True)
    out, ref = apply_rotary(q1, k1, cos, sin), reference(q2, k2, cos, sin)
    cots = [torch.randn(r.shape).to(dtype) for r in ref]
    torch.autograd.backward(out, cots)
    torch.autograd.backward(ref, cots)
    for name, o, e in zip("qk", out, ref):
        assert o.dtype == e.dtype and o.shape == e.shape
        assert_close_scaled(o, e, dtype, f"{name} out")
    assert_close_scaled(q1.grad, q2.grad, dtype, "grad q")
    assert_close_scaled(k1.grad, k2.grad, dtype, "grad k")


def test_reference_is_hf_and_kernel_matches_hf():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(2, 4, 9, 64), torch.randn(2, 2, 9, 64)
    cos, sin = _cos_sin(1, 9, 64, torch.float32)
    hf = apply_rotary_pos_emb(q, k, cos, sin)
    for ours, theirs in zip(reference(q, k, cos, sin), hf):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(apply_rotary(q, k, cos, sin), hf):
        assert_close_scaled(ours, theirs, torch.float32, "kernel vs HF")


def test_shape_errors():
    q, k = torch.randn(2, 4, 9, 64), torch.randn(2, 2, 9, 64)
    cos, sin = _cos_sin(1, 9, 64, torch.float32)
    with pytest.raises(SchedlangError, match=r"expected q \(B, Hq, S, D\), k \(B, Hk, S, D\) and cos/sin \(B, S, D\), "
                                             r"got q \(4, 9, 64\)"):
        apply_rotary(q[0], k, cos, sin)
    with pytest.raises(ValueError, match=r"shapes do not fit: q \(2, 4, 9, 64\), k \(2, 2, 8, 64\), cos/sin \(1, 9, 64\)"):
        apply_rotary(q, k[:, :, :8], cos, sin)


def test_inputs_must_be_floating_point_tensors():
    q, k = torch.randn(2, 4, 9, 64), torch.randn(2, 2, 9, 64)
    cos, sin = _cos_sin(1, 9, 64, torch.float32)
    with pytest.raises(ScheduleValueError, match=r"apply_rotary: k must be a torch.Tensor, got list"):
        apply_rotary(q, k.tolist(), cos, sin)
    with pytest.raises(ScheduleValueError, match=r"apply_rotary: q has dtype torch.int64: expected one of float32"):
        apply_rotary(q.long(), k, cos, sin)


@pytest.mark.gpu
def test_llama_sizes_on_gpu():
    q = torch.randn(4, 2048, 32, 64).bfloat16().transpose(1, 2)
    k = torch.randn(4, 2048, 4, 64).bfloat16().transpose(1, 2)
    cos, sin = _cos_sin(1, 2048, 64, torch.bfloat16)
    q1, k1 = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
    q2, k2 = q.detach().float().requires_grad_(True), k.detach().float().requires_grad_(True)
    out, ref = apply_rotary(q1, k1, cos, sin), reference(q2, k2, cos.float(), sin.float())
    cots = [torch.randn_like(r).bfloat16() for r in ref]
    torch.autograd.backward(out, cots)
    torch.autograd.backward(ref, [c.float() for c in cots])
    for o, e in zip(out, ref):
        assert_close_scaled(o, e, torch.bfloat16, "out")
    assert_close_scaled(q1.grad, q2.grad, torch.bfloat16, "grad q")
    assert_close_scaled(k1.grad, k2.grad, torch.bfloat16, "grad k")

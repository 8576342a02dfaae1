"""Repeated calls of a triton-fused module: the per-call cache (specialization, kernel
inputs, launch choices, and on CUDA the compiled binaries launched directly) must give the
same results as a first call, whatever changes between calls (shapes, strides, alignment,
module mode, weights, dropout seeds, launch hooks)."""

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from schedlang.errors import LoweringError
from schedlang.lowering import lower_subgraph

from .utils import DEVICE


class BiasDropResidualNorm(nn.Module):
    def __init__(self, hidden=13, p=0.5):
        super().__init__()
        self.dropout = nn.Dropout(p)
        self.ln = nn.LayerNorm(hidden)

    def forward(self, x, bias, residual):
        return self.ln(self.dropout(x + bias) + residual)


def _block(hidden=13):
    block = BiasDropResidualNorm(hidden).to(DEVICE).eval()
    with torch.no_grad():
        block.ln.weight.normal_()
        block.ln.bias.normal_()
    return block


def _fuse(block):
    return lower_subgraph(torch.fx.symbolic_trace(copy.deepcopy(block)), "triton", "BiasDropResLN").eval()


def _check_against_float64(fused, block, inputs):
    """Output and gradients (inputs and LayerNorm weights) of ``fused`` against ``block``
    run in float64 on the same values."""
    ours_in = [t.detach().requires_grad_() for t in inputs]
    ref_block = BiasDropResidualNorm(block.ln.normalized_shape[0]).to(DEVICE).double().eval()
    ref_block.load_state_dict({k: v.double() for k, v in block.state_dict().items()})
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    y, want = fused(*ours_in), ref_block(*ref_in)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(want)
    got = torch.autograd.grad(y, ours_in + [fused.ln.weight, fused.ln.bias], dy.to(y.dtype))
    expect = torch.autograd.grad(want, ref_in + [ref_block.ln.weight, ref_block.ln.bias], dy)
    for a, b in zip(got, expect):
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double() / scale, b / scale, rtol=1e-5, atol=1e-5)


def test_repeated_calls_with_alternating_shapes_match_pytorch():
    block = _block()
    fused = _fuse(block)
    for rows in (7, 7, 5, 7, 5):
        x, r = torch.randn(rows, 13, device=DEVICE), torch.randn(rows, 13, device=DEVICE)
        _check_against_float64(fused, block, [x, torch.randn(13, device=DEVICE), r])
    assert len(fused.specializations) == 2


def test_strided_and_unaligned_inputs_after_contiguous_ones():
    block = _block()
    fused = _fuse(block)
    rows = 9
    contiguous = [torch.randn(rows, 13, device=DEVICE), torch.randn(13, device=DEVICE),
                  torch.randn(rows, 13, device=DEVICE)]
    _check_against_float64(fused, block, contiguous)
    transposed = torch.randn(13, rows, device=DEVICE).t()  # column-major
    every_other = torch.randn(26, device=DEVICE)[::2]  # a strided bias
    # one element into the storage: the address is not 16-byte aligned
    shifted = torch.randn(rows * 13 + 1, device=DEVICE)[1:].view(rows, 13)
    row_pitch = torch.randn(rows, 20, device=DEVICE)[:, 3:16]  # rows further apart than 13
    for inputs in ([transposed, contiguous[1], shifted], [shifted, every_other, row_pitch],
                   [row_pitch, contiguous[1], transposed], contiguous):
        _check_against_float64(fused, block, inputs)


def test_column_gradients_of_several_inputs_are_separate_tensors():
    block = _block()
    fused = _fuse(block)
    x, r = torch.randn(6, 13, device=DEVICE), torch.randn(6, 13, device=DEVICE)
    b = torch.randn(13, device=DEVICE, requires_grad=True)
    y = fused(x, b, r)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert fused.ln.weight.grad.shape == fused.ln.bias.grad.shape == b.grad.shape == (13,)
    fused.ln.weight.grad.zero_()  # the gradients do not overlap: the others keep their values
    ref_block = BiasDropResidualNorm(13).to(DEVICE).double().eval()
    ref_block.load_state_dict({k: v.double() for k, v in block.state_dict().items()})
    b_ref = b.detach().double().requires_grad_()
    ref_block(x.double(), b_ref, r.double()).backward(dy.double())
    for got, want in ((fused.ln.bias.grad, ref_block.ln.bias.grad), (b.grad, b_ref.grad)):
        scale = want.abs().max()
        torch.testing.assert_close(got.double() / scale, want / scale, rtol=1e-5, atol=1e-5)


def test_module_mode_and_replaced_weights_are_seen_by_later_calls():
    block = _block()
    fused = _fuse(block)
    x, b, r = torch.randn(8, 13, device=DEVICE), torch.randn(13, device=DEVICE), torch.randn(8, 13, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, b, r), block(x, b, r))
        fused.train()  # dropout on: the sum before the norm loses about half its terms
        dropped = fused(x, b, r)
        assert (dropped - block(x, b, r)).abs().max() > 1e-3
        fused.eval()
        torch.testing.assert_close(fused(x, b, r), block(x, b, r))
        weight = torch.randn(13, device=DEVICE)
        fused.ln.weight = nn.Parameter(weight)
        want = F.layer_norm(x + b + r, (13,), weight, block.ln.bias)
        torch.testing.assert_close(fused(x, b, r), want)


def test_dropout_masks_of_repeated_calls_match_their_gradients():
    p = 0.25
    fused = lower_subgraph(torch.fx.symbolic_trace(lambda x: F.dropout(x, p, True)), "triton", "Drop")
    masks = []
    for _ in range(4):  # a new seed each call
        x = (torch.rand(16, 24, device=DEVICE) + 0.5).requires_grad_()  # never 0
        y = fused(x)
        kept = y != 0
        torch.testing.assert_close(y[kept], x[kept] / (1 - p))
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, dy)
        torch.testing.assert_close(dx, torch.where(kept, dy / (1 - p), torch.zeros_like(dy)))
        masks.append(kept)
    assert not all(torch.equal(masks[0], m) for m in masks[1:])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter switch matters off CUDA")
def test_interpreter_switch_is_checked_at_every_call(monkeypatch):
    fused = lower_subgraph(torch.fx.symbolic_trace(lambda x, b: torch.tanh(x + b)), "triton", "BiasTanh")
    x, b = torch.randn(4, 13), torch.randn(13)
    torch.testing.assert_close(fused(x, b), torch.tanh(x + b))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(LoweringError, match=r"BiasTanh: compiler='triton' runs on CUDA tensors \(or on CPU with "
                                            r"TRITON_INTERPRET=1\), got tensors on cpu"):
        fused(x, b)


def _kernels(fused):
    return [k for compiled in fused._compiled.values() for k in compiled._kernels.values()]


@pytest.mark.gpu
def test_direct_launches_reuse_the_binary_of_the_first_call():
    gm = torch.fx.symbolic_trace(lambda x, b: F.gelu(x + b))
    fused = lower_subgraph(gm, "triton", "BiasGeLU")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    first = fused(x, b)
    first_grads = torch.autograd.grad(first, (x, b), dy)
    for _ in range(3):  # launched without the JIT: bit for bit the same kernels
        y = fused(x, b)
        assert torch.equal(y, first)
        for a, w in zip(torch.autograd.grad(y, (x, b), dy), first_grads):
            assert torch.equal(a, w)
    kernels = _kernels(fused)
    if os.environ.get("SCHEDLANG_DIRECT_LAUNCH", "1") != "0":
        assert all(k._direct and k._binaries for k in kernels)
    # an unaligned input is another specialization of the JIT
    shifted = torch.randn(64 * 256 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(64, 256)
    for _ in range(2):
        torch.testing.assert_close(fused(shifted, b.detach()), F.gelu(shifted + b.detach()), rtol=1.6e-2, atol=1e-2)
        with torch.no_grad():
            assert torch.equal(fused(x, b), first)


@pytest.mark.gpu
def test_launch_hooks_see_every_launch():
    from triton import knobs

    fused = lower_subgraph(torch.fx.symbolic_trace(lambda x, b: torch.tanh(x + b)), "triton", "BiasTanh")
    x, b = torch.randn(32, 64, device="cuda"), torch.randn(64, device="cuda")
    fused(x, b)  # the binary is known: later launches could skip the JIT
    seen = []

    def hook(metadata):
        seen.append(metadata)

    hooks = knobs.runtime.launch_enter_hook
    if not hasattr(hooks, "add"):
        pytest.skip("this Triton has no launch hook chain")
    hooks.add(hook)
    try:
        for _ in range(3):
            torch.testing.assert_close(fused(x, b), torch.tanh(x + b))
    finally:
        hooks.remove(hook)
    assert len(seen) == 3

"""rms_norm (Triton, interpreted on CPU) against its reference and HF's LlamaRMSNorm, outputs and gradients."""

import pytest
import torch

from schedlang.errors import SchedlangError, ScheduleValueError
from schedlang.kernels import rms_norm
from schedlang.kernels.rms_norm import reference
from tests.helpers.compiling import no_compile_caches
from tests.kernels.numerics import assert_close_scaled

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (13, 100), (2, 5, 96)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_reference(shape, dtype, with_residual):
    n = shape[-1]
    x = torch.randn(shape).to(dtype)
    w = (1 + 0.3 * torch.randn(n)).to(dtype)
    r = torch.randn(shape).to(dtype) if with_residual else None
    ours, theirs = _leaves(x, w, r), _leaves(x, w, r)
    out = rms_norm(ours[0], ours[1], 1e-5, ours[2])
    ref = reference(theirs[0], theirs[1], 1e-5, theirs[2])
    outs, refs = (out, ref) if with_residual else ((out,), (ref,))
    cots = [torch.randn(o.shape).to(o.dtype) for o in refs]
    torch.autograd.backward(outs, cots)
    torch.autograd.backward(refs, cots)
    for i, (o, e) in enumerate(zip(outs, refs)):
        assert o.dtype == e.dtype
        assert_close_scaled(o, e, dtype, f"output {i}")
    for name, a, b in zip(("x", "weight", "residual"), ours, theirs):
        if a is not None:
            assert a.grad.dtype == b.grad.dtype
            assert_close_scaled(a.grad, b.grad, dtype, f"grad {name}")


def test_many_rows_weight_gradient():
    """1000 rows: several row blocks per backward program and the partial dw buffer summed."""
    x, w = torch.randn(1000, 96), 1 + 0.3 * torch.randn(96)
    ours, theirs = _leaves(x, w), _leaves(x, w)
    cot = torch.randn(1000, 96)
    rms_norm(ours[0], ours[1], 1e-6).backward(cot)
    reference(theirs[0], theirs[1], 1e-6).backward(cot)
    assert_close_scaled(ours[0].grad, theirs[0].grad, torch.float32, "grad x")
    assert_close_scaled(ours[1].grad, theirs[1].grad, torch.float32, "grad weight")


def test_reference_is_hf_llama_rms_norm_bit_for_bit():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for dtype in DTYPES:
        hf = LlamaRMSNorm(100, eps=1e-5).to(dtype)
        with torch.no_grad():
            hf.weight.copy_(1 + 0.3 * torch.randn(100))
        x = torch.randn(13, 100).to(dtype)
        assert torch.equal(reference(x, hf.weight, hf.variance_epsilon), hf(x))
        # and the kernel against HF itself
        assert_close_scaled(rms_norm(x, hf.weight, hf.variance_epsilon), hf(x), dtype, "kernel vs HF")


def test_fp32_weight_on_bf16_input_gives_fp32_like_hf():
    x, w = torch.randn(7, 64).to(torch.bfloat16), 1 + 0.3 * torch.randn(64)
    out, ref = rms_norm(x, w, 1e-6), reference(x, w, 1e-6)
    assert out.dtype == ref.dtype == torch.float32
    assert_close_scaled(out, ref, torch.float32, "output")


def test_errors_name_the_shapes():
    with pytest.raises(SchedlangError, match=r"weight of shape \(32,\) does not fit inputs of shape \(7, 64\): "
                                             r"expected \(64,\)"):
        rms_norm(torch.randn(7, 64), torch.ones(32))
    with pytest.raises(ValueError, match=r"residual \(7, 32\) torch.float32 must match x \(7, 64\)"):
        rms_norm(torch.randn(7, 64), torch.ones(64), residual=torch.randn(7, 32))


@pytest.mark.parametrize("call, message", [
    (lambda: rms_norm(torch.tensor(1.0), torch.ones(())), r"rms_norm: x of shape \(\) must have at least 1 dimension"),
    (lambda: rms_norm(torch.randn(4, 8), torch.ones(())), r"rms_norm: weight of shape \(\) must have at least 1 dimension"),
    (lambda: rms_norm([1.0, 2.0], torch.ones(2)), r"rms_norm: x must be a torch.Tensor, got list"),
    (lambda: rms_norm(torch.ones(4, 8, dtype=torch.long), torch.ones(8)),
     r"rms_norm: x has dtype torch.int64: expected one of float32, bfloat16, float16, float64"),
    (lambda: rms_norm(torch.randn(4, 8), torch.ones(8), eps="x"), r"rms_norm: eps must be a finite number >= 0, got 'x'"),
    (lambda: rms_norm(torch.randn(4, 8), torch.ones(8), eps=-1), r"rms_norm: eps must be a finite number >= 0, got -1"),
    (lambda: rms_norm(torch.randn(4, 8), torch.ones(8), residual=[0.0] * 8),
     r"rms_norm: residual must be a torch.Tensor, got list"),
], ids=["0-d x", "0-d weight", "list", "long", "eps str", "eps negative", "residual list"])
def test_bad_inputs_are_refused_by_name(call, message):
    with pytest.raises(ScheduleValueError, match=message):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_llama_sizes_on_gpu(dtype):
    x, w, r = torch.randn(4 * 2048, 2048).to(dtype), (1 + 0.3 * torch.randn(2048)).to(dtype), torch.randn(4 * 2048, 2048).to(dtype)
    ours, theirs = _leaves(x, w, r), _leaves(x, w, r)
    out, ref = rms_norm(ours[0], ours[1], 1e-5, ours[2]), reference(theirs[0], theirs[1], 1e-5, theirs[2])
    cots = [torch.randn_like(o) for o in ref]
    torch.autograd.backward(out, cots)
    torch.autograd.backward(ref, cots)
    for o, e in zip(out, ref):
        assert_close_scaled(o, e, dtype, "output")
    for a, b in zip(ours, theirs):
        assert_close_scaled(a.grad, b.grad, dtype, "grad")


def _ops_in_graph(fn, *args):
    """Run ``fn`` compiled by Inductor and return the names of the ops in the graphs it compiled."""
    seen = []

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        def inner_compile(graph, inputs, **kwargs):
            seen.extend(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
            from torch._inductor.compile_fx import compile_fx_inner

            return compile_fx_inner(graph, inputs, **kwargs)

        return compile_fx(gm, example_inputs, inner_compile=inner_compile)

    torch._dynamo.reset()
    with no_compile_caches():  # a cached graph would skip inner_compile
        return torch.compile(fn, backend=backend, fullgraph=True)(*args), seen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_under_torch_compile_the_kernels_run_as_custom_operators(dtype, with_residual):
    """Inside a compiled graph the norm is schedlang's forward and backward operators (Inductor calls
    them), with the reference's values and gradients; a neighbouring op stays Inductor's."""
    x = torch.randn(3, 5, 96).to(dtype)
    w = (1 + 0.3 * torch.randn(96)).to(dtype)
    r = torch.randn(3, 5, 96).to(dtype) if with_residual else None
    ours, theirs = _leaves(x, w, r), _leaves(x, w, r)

    def layer(x, w, r):
        out = rms_norm(x * 2, w, 1e-5, r, compiled="kernel")
        return tuple(o * 3 for o in out) if r is not None else out * 3

    out, ops = _ops_in_graph(layer, *ours)
    ref = reference(theirs[0] * 2, theirs[1], 1e-5, theirs[2])
    ref = tuple(o * 3 for o in ref) if with_residual else ref * 3
    outs, refs = (out, ref) if with_residual else ((out,), (ref,))
    cots = [torch.randn(o.shape).to(o.dtype) for o in refs]
    torch.autograd.backward(outs, cots)
    torch.autograd.backward(refs, cots)
    assert ops.count("schedlang.rms_norm_forward.default") == 1
    assert ops.count("schedlang.rms_norm_backward.default") == 1
    assert not any("rsqrt" in op for op in ops), ops  # the norm is not also traced
    assert "aten.mul.Tensor" in ops
    for i, (o, e) in enumerate(zip(outs, refs)):
        assert o.dtype == e.dtype
        assert_close_scaled(o, e, dtype, f"output {i}")
    for name, a, b in zip(("x", "weight", "residual"), ours, theirs):
        if a is not None:
            assert_close_scaled(a.grad, b.grad, dtype, f"grad {name}")


@pytest.mark.parametrize("compiled, interpreting", [("inductor", True), ("kernel", False)])
def test_compiled_by_default_or_without_a_kernel_for_the_inputs_the_reference_is_traced(monkeypatch, compiled,
                                                                                          interpreting):
    """By default, and where the kernels do not run (here: the CPU without the interpreter), Inductor
    compiles the reference."""
    monkeypatch.setattr("schedlang.kernels.row_kernels.interpreting", lambda: interpreting)
    x, w = _leaves(torch.randn(7, 64), 1 + 0.3 * torch.randn(64))
    out, ops = _ops_in_graph(lambda x, w: rms_norm(x, w, 1e-5, compiled=compiled), x, w)
    assert not any(op.startswith("schedlang.") for op in ops) and any("rsqrt" in op for op in ops)
    assert_close_scaled(out, reference(x, w, 1e-5), torch.float32, "output")


def test_an_unknown_compiled_form_is_refused():
    with pytest.raises(SchedlangError, match=r"rms_norm: compiled='triton' is not a form of the norm under "
                                             r"torch.compile: expected one of \('inductor', 'kernel'\)"):
        rms_norm(torch.randn(7, 64), torch.ones(64), compiled="triton")


@pytest.mark.gpu
def test_under_torch_compile_at_llama_sizes_on_gpu():
    x, w, r = (torch.randn(4 * 2048, 2048, device="cuda").bfloat16(), (1 + 0.3 * torch.randn(2048, device="cuda")).bfloat16(),
               torch.randn(4 * 2048, 2048, device="cuda").bfloat16())
    ours, theirs = _leaves(x, w, r), _leaves(x, w, r)
    out, ops = _ops_in_graph(lambda x, w, r: rms_norm(x, w, 1e-5, r, compiled="kernel"), *ours)
    ref = reference(theirs[0], theirs[1], 1e-5, theirs[2])
    cots = [torch.randn_like(o) for o in ref]
    torch.autograd.backward(out, cots)
    torch.autograd.backward(ref, cots)
    assert "schedlang.rms_norm_forward.default" in ops
    for o, e in zip(out, ref):
        assert_close_scaled(o, e, torch.bfloat16, "output")
    for a, b in zip(ours, theirs):
        assert_close_scaled(a.grad, b.grad, torch.bfloat16, "grad")

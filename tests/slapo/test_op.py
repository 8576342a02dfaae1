"""schedlang.op against plain PyTorch: outputs and gradients, irregular shapes, per-dtype tolerances."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import schedlang as slapo
from schedlang import op
from schedlang.op.attention import AttentionKernelError, flash_attn_ref
from schedlang.op.fused_bias import ACTIVATIONS, bias_act

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-10, rtol=1e-10),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _grads(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    out.backward(torch.randn_like(out, generator=torch.Generator().manual_seed(1)))
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 13), (2, 3, 1000)])
def test_bias_gelu_matches_tanh_gelu_of_the_sum(dtype, shape):
    x, b = torch.randn(shape, dtype=dtype), torch.randn(shape[-1], dtype=dtype)
    out, grads = _grads(op.bias_gelu, x, b)
    ref, ref_grads = _grads(lambda x, b: F.gelu(x + b, approximate="tanh"), x, b)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **(TOL[dtype] if dtype != torch.bfloat16 else dict(atol=0.1, rtol=0.05)))
    torch.testing.assert_close(op.new_gelu(x.double()), F.gelu(x.double(), approximate="tanh"))


@pytest.mark.parametrize("name", ["gelu", "relu", "silu", "gelu_new"])
def test_bias_act_matches_activation_of_the_sum(name):
    x, b = torch.randn(7, 13, dtype=torch.float64), torch.randn(13, dtype=torch.float64)
    reference = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "gelu_new": lambda t: F.gelu(t, approximate="tanh")}
    out, grads = _grads(lambda x, b: bias_act(x, b, ACTIVATIONS[name]), x, b)
    ref, ref_grads = _grads(lambda x, b: reference[name](x + b), x, b)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def _copy_linear(new, old):
    with torch.no_grad():
        new.weight.copy_(old.weight)
        new.bias.copy_(old.bias)
    return new


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu"])
def test_linear_with_act_is_linear_then_activation(act):
    ref = nn.Linear(13, 7)
    fused = _copy_linear(op.LinearWithAct(13, 7, act_fn=act), ref)
    x = torch.randn(3, 5, 13)
    f = {"gelu": F.gelu, "gelu_new": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu}[act]
    out, (gx,) = _grads(fused, x)
    want, (wx,) = _grads(lambda t: f(ref(t)), x)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    torch.testing.assert_close(gx, wx, **TOL[torch.float32])


def test_linear_with_dropout_draws_the_same_mask_as_dropout_of_the_linear():
    ref = nn.Linear(13, 1000)
    fused = _copy_linear(op.LinearWithDropout(13, 1000, p=0.3), ref)
    x = torch.randn(7, 13)
    torch.manual_seed(5)
    out = fused(x)
    torch.manual_seed(5)
    want = F.dropout(ref(x), p=0.3, training=True)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    assert (out == 0).float().mean().item() == pytest.approx(0.3, abs=0.05)
    fused.eval()
    torch.testing.assert_close(fused(x), ref(x), **TOL[torch.float32])


def test_linear_with_sync_func_syncs_before_the_bias():
    seen = []
    lin = op.LinearWithSyncFunc(13, 7, sync_fn=lambda t: seen.append(t.detach().clone()) or t * 2)
    x = torch.randn(3, 13)
    out = lin(x)
    torch.testing.assert_close(seen[0], x @ lin.weight.T)
    torch.testing.assert_close(out, 2 * (x @ lin.weight.T) + lin.bias)
    assert "sync_fn=<lambda>" in repr(lin)
    sep = _copy_linear(op.LinearWithSeparateBias(13, 7), lin)
    torch.testing.assert_close(sep(x), F.linear(x, lin.weight, lin.bias))


def test_fused_qkv_gives_whole_heads_and_matches_separate_projections():
    hidden, heads = 24, 4
    q, k, v = (nn.Linear(hidden, hidden) for _ in range(3))
    fused = op.FusedQKV(hidden, heads, world_size=1)
    d = hidden // heads
    with torch.no_grad():
        w = torch.stack([m.weight.view(heads, d, hidden) for m in (q, k, v)], dim=2)  # (H, D, 3, in)
        fused.fused_linear.weight.copy_(w.reshape(3 * hidden, hidden))
        fused.fused_linear.bias.copy_(torch.stack([m.bias.view(heads, d) for m in (q, k, v)], dim=2).reshape(-1))
    x = torch.randn(2, 5, hidden)
    for got, proj in zip(fused(x), (q, k, v)):
        torch.testing.assert_close(got, proj(x).view(2, 5, heads, d), **TOL[torch.float32])
    with pytest.raises(ValueError, match="4 heads do not split over world_size 3"):
        op.FusedQKV(hidden, heads, world_size=3)


def test_fused_mlp_matches_gpt2_mlp():
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    config = GPT2Config(n_embd=24, resid_pdrop=0.0, activation_function="gelu_new")
    ref = GPT2MLP(40, config)
    mlp = op.FusedMLP(24, 40, "gelu_new", resid_pdrop=0.0)
    with torch.no_grad():  # HF's Conv1D keeps (in, out) weights
        mlp.fc_in.weight.copy_(ref.c_fc.weight.T)
        mlp.fc_in.bias.copy_(ref.c_fc.bias)
        mlp.fc_out.weight.copy_(ref.c_proj.weight.T)
        mlp.fc_out.bias.copy_(ref.c_proj.bias)
    x = torch.randn(3, 7, 24)
    out, (gx,) = _grads(mlp, x)
    want, (wx,) = _grads(ref, x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, wx, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["math", "flash", "auto", "native_flash_attn"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_kernels_match_the_reference(kernel, causal):
    b, s, h, d = 2, 7, 3, 8
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    mask = torch.where(torch.rand(b, 1, 1, s) < 0.2, float("-inf"), 0.0)
    mask[..., 0] = 0.0  # every query keeps a key
    attn = op.FlashAttentionOp(kernel, apply_causal_mask=causal)
    out, grads = _grads(lambda q, k, v: attn(q, k, v, mask, p=0.0), q, k, v)
    ref, ref_grads = _grads(lambda q, k, v: flash_attn_ref(q, k, v, bias=mask, causal=causal), q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["flash", "auto", "cuda", "triton"])
def test_a_mask_that_needs_a_gradient_runs_on_the_math_kernel(kernel, caplog):
    b, s, h, d = 2, 6, 2, 8
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    mask = torch.randn(b, 1, 1, s)  # HF's additive mask, as Slapo's attention test makes it: it gets a gradient
    attn = op.FlashAttentionOp(kernel, apply_causal_mask=True)
    with caplog.at_level("WARNING", logger="schedlang.op.attention"):
        out, grads = _grads(lambda q, k, v, m: attn(q, k, v, m, p=0.0), q, k, v, mask)
    ref, ref_grads = _grads(lambda q, k, v, m: flash_attn_ref(q, k, v, bias=m, causal=True), q, k, v, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    for g, r in zip(grads, ref_grads):  # the mask's gradient too
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
    if kernel != "auto":
        assert "running" in caplog.text and "with the 'math' kernel" in caplog.text


def test_flash_attention_module_fused_equals_separate_projections():
    torch.manual_seed(3)
    sep = op.FlashAttention(24, 4, fused_qkv=False, attn_op_name="math")
    fused = op.FlashAttention(24, 4, fused_qkv=True, attn_op_name="flash")
    d = 6
    with torch.no_grad():
        w = torch.cat([m.weight.view(4, d, 24) for m in (sep.query, sep.key, sep.value)], dim=1)  # (H, 3D, in)
        fused.qkv.weight.copy_(w.reshape(72, 24))
        fused.qkv.bias.copy_(torch.cat([m.bias.view(4, d) for m in (sep.query, sep.key, sep.value)], 1).reshape(-1))
        fused.out_proj.load_state_dict(sep.out_proj.state_dict())
    x = torch.randn(2, 9, 24)
    torch.testing.assert_close(fused(x)[0], sep(x)[0], atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_only_kernel_raises_a_clear_error_on_cpu():
    with pytest.raises(AttentionKernelError, match="'efficient' .* needs a CUDA device .* use 'flash' or 'math'"):
        op.FlashAttentionOp("efficient")


def test_unknown_kernel_name_lists_the_valid_ones():
    with pytest.raises(AttentionKernelError, match="unknown attention kernel 'fast': valid are auto, math, flash"):
        op.FlashAttentionOp("fast")


def test_print_stays_a_call_when_traced_and_prints_at_run_time(capsys):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(5, 5)
            self.print = op.Print()

        def forward(self, x):
            out = self.linear(x) + x
            return self.print(out, "shape:", out.shape)

    sch = slapo.create_schedule(Model())
    sch.trace()
    assert "self.print(" in sch.mod.code
    capsys.readouterr()
    model, _ = slapo.build(sch, init_weights=False)
    model(torch.randn(3, 5))
    assert "shape: torch.Size([3, 5])" in capsys.readouterr().out

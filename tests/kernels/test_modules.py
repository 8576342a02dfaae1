"""Drop-in modules against the HF modules they replace, built from small configs."""

import pytest
import torch
from torch import nn

from schedlang.errors import SchedlangError, ScheduleValueError
from schedlang.kernels.modules import FusedRMSNorm, FusedSwiGLUMLP, fused_apply_rotary_pos_emb, fused_causal_lm_loss
from tests.kernels.numerics import assert_close_scaled


def _tiny_llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=100, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config).to(dtype)


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_rms_norm_shares_the_weight_and_matches_hf():
    model = _tiny_llama()
    hf = model.model.norm
    with torch.no_grad():
        hf.weight.add_(0.3 * torch.randn(64))
    fused = FusedRMSNorm.from_module(hf)
    assert fused.weight is hf.weight and fused.variance_epsilon == hf.variance_epsilon
    assert dict(fused.named_parameters()).keys() == dict(hf.named_parameters()).keys()
    x = torch.randn(2, 7, 64)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out = fused(x1)
    out.sum().backward()
    w_grad = hf.weight.grad.clone()
    hf.weight.grad = None
    ref = hf(x2)
    ref.sum().backward()
    assert_close_scaled(out, ref, torch.float32, "output")
    assert_close_scaled(x1.grad, x2.grad, torch.float32, "grad x")
    assert_close_scaled(w_grad, hf.weight.grad, torch.float32, "grad weight")
    # with a residual: outputs (norm of the sum, the sum) and the gradients of both addends and the weight
    r = torch.randn(2, 7, 64)
    x1, r1 = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
    x2, r2 = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
    cot_y, cot_s = torch.randn(2, 7, 64), torch.randn(2, 7, 64)
    hf.weight.grad = None
    y, residual = fused(x1, residual=r1)
    torch.autograd.backward((y, residual), (cot_y, cot_s))
    w_grad = hf.weight.grad.clone()
    hf.weight.grad = None
    s = x2 + r2
    torch.autograd.backward((hf(s), s), (cot_y, cot_s))
    assert_close_scaled(residual, x + r, torch.float32, "residual")
    assert_close_scaled(y, hf(x + r), torch.float32, "fused residual output")
    assert_close_scaled(x1.grad, x2.grad, torch.float32, "residual: grad x")
    assert_close_scaled(r1.grad, r2.grad, torch.float32, "residual: grad residual")
    assert_close_scaled(w_grad, hf.weight.grad, torch.float32, "residual: grad weight")
    assert "eps=" in repr(fused)


def test_swiglu_mlp_matches_llama_mlp():
    model = _tiny_llama()
    mlp = model.model.layers[0].mlp
    fused = FusedSwiGLUMLP.from_module(mlp)
    assert fused.gate_proj is mlp.gate_proj
    x = torch.randn(3, 5, 64)
    fused(x).pow(2).sum().backward()
    ours = _grads(mlp)
    mlp.zero_grad()
    mlp(x).pow(2).sum().backward()
    theirs = _grads(mlp)
    assert_close_scaled(fused(x), mlp(x), torch.float32, "output")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert_close_scaled(ours[name], theirs[name], torch.float32, f"grad {name}")


def test_rotary_function_matches_hf_both_layouts():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(2, 4, 9, 64), torch.randn(2, 2, 9, 64)
    angles = torch.randn(1, 9, 32)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    for dim, (q_in, k_in) in ((1, (q, k)), (2, (q.transpose(1, 2), k.transpose(1, 2)))):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q_in, k_in, q_in, k_in)]
        ours = fused_apply_rotary_pos_emb(leaves[0], leaves[1], cos, sin, unsqueeze_dim=dim)
        theirs = apply_rotary_pos_emb(leaves[2], leaves[3], cos, sin, unsqueeze_dim=dim)
        cots = [torch.randn(t.shape) for t in theirs]
        torch.autograd.backward(ours, cots)
        torch.autograd.backward(theirs, cots)
        for name, o, t in zip("qk", ours, theirs):
            assert o.shape == t.shape
            assert_close_scaled(o, t, torch.float32, f"{name}, unsqueeze_dim={dim}")
        for name, o, t in zip("qk", leaves[:2], leaves[2:]):
            assert_close_scaled(o.grad, t.grad, torch.float32, f"grad {name}, unsqueeze_dim={dim}")
    with pytest.raises(SchedlangError, match=r"unsqueeze_dim=3: valid are 1"):
        fused_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3)


@pytest.mark.parametrize("num_items", [None, 7])
def test_causal_lm_loss_is_hf_loss(num_items):
    model = _tiny_llama()
    ids = torch.randint(0, 96, (2, 11))
    labels = ids.clone()
    labels[0, :3] = -100
    kw = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    hf_loss = model(ids, labels=labels, **kw).loss
    hf_loss.backward()
    theirs = _grads(model)
    model.zero_grad()
    hidden = model.model(ids).last_hidden_state
    ours_loss = fused_causal_lm_loss(hidden, model.lm_head, labels, **kw)
    ours_loss.backward()
    ours = _grads(model)
    assert_close_scaled(ours_loss, hf_loss, torch.float32, "loss")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert_close_scaled(ours[name], theirs[name], torch.float32, f"grad {name}")


def test_from_module_errors():
    with pytest.raises(SchedlangError, match=r"FusedRMSNorm.from_module: Linear is not an RMSNorm"):
        FusedRMSNorm.from_module(nn.Linear(4, 4))
    mlp = _tiny_llama().model.layers[0].mlp
    mlp.act_fn = nn.GELU()
    with pytest.raises(ValueError, match=r"LlamaMLP.act_fn is GELU: only SiLU"):
        FusedSwiGLUMLP.from_module(mlp)
    with pytest.raises(TypeError, match=r"Linear has no gate_proj, up_proj, down_proj"):
        FusedSwiGLUMLP.from_module(nn.Linear(4, 4))
    with pytest.raises(SchedlangError, match=r"labels of shape \(2, 5\) do not fit hidden states of shape \(2, 6, 8\)"):
        fused_causal_lm_loss(torch.randn(2, 6, 8), nn.Linear(8, 10), torch.zeros(2, 5, dtype=torch.long))


@pytest.mark.parametrize("call, message", [
    (lambda: FusedRMSNorm(0), r"FusedRMSNorm: hidden_size must be an int >= 1, got 0"),
    (lambda: FusedRMSNorm(8.0), r"FusedRMSNorm: hidden_size must be an int >= 1, got 8.0"),
    (lambda: FusedRMSNorm(8, eps="x"), r"FusedRMSNorm: eps must be a finite number >= 0, got 'x'"),
    (lambda: FusedSwiGLUMLP(8, -16), r"FusedSwiGLUMLP: intermediate_size must be an int >= 1, got -16"),
    (lambda: fused_causal_lm_loss(torch.randn(2, 6, 8), nn.Linear(8, 10), [[0] * 6] * 2),
     r"fused_causal_lm_loss: labels must be a torch.Tensor, got list"),
    (lambda: fused_apply_rotary_pos_emb([0.0], torch.randn(1, 2, 3, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4),
                                        unsqueeze_dim=2),
     r"fused_apply_rotary_pos_emb: q must be a torch.Tensor, got list"),
], ids=["size 0", "size float", "eps str", "intermediate negative", "labels list", "rotary list"])
def test_bad_sizes_and_inputs_are_refused_by_name(call, message):
    with pytest.raises(ScheduleValueError, match=message):
        call()


def test_fused_rms_norm_keeps_its_compiled_form_and_refuses_an_unknown_one():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert FusedRMSNorm(8).compiled == "inductor"
    fused = FusedRMSNorm.from_module(LlamaRMSNorm(8), compiled="kernel")
    assert fused.compiled == "kernel" and "compiled='kernel'" in repr(fused)
    with pytest.raises(SchedlangError, match=r"FusedRMSNorm: compiled='fast' is not a form of the norm under "
                                             r"torch.compile: expected one of \('inductor', 'kernel'\)"):
        FusedRMSNorm(8, compiled="fast")

"""FusedAdam(W) with fp32 master weights against torch.optim on fp32 weights whose forward uses
bf16 (or fp16) copies: the masters follow torch.optim's fp32 parameters, and the parameters are
exactly the masters rounded."""

import io
import logging

import pytest
import torch

from schedlang.errors import ScheduleTypeError, ScheduleValueError
from schedlang.optim import FusedAdam, FusedAdamW

SHAPES = [(7, 13), (1000,), (1,), (3, 5, 7)]
STEPS = 8


def _fp32_params(shapes=SHAPES):
    return [torch.randn(s, requires_grad=True) for s in shapes]


def _twins(shapes=SHAPES):
    ref = _fp32_params(shapes)
    ours = [p.detach().clone().requires_grad_(True) for p in ref]
    return ours, ref


def _loss(weights, inputs):
    """A loss computed in the weights' dtype, touching every weight non-linearly."""
    w, v, s, t = weights
    x, u, z = inputs
    y = torch.tanh(x @ w.t()).square().sum()
    return (y + (v * u).sin().sum() + (s * 3.0).exp().sum() + (t * z).tanh().square().sum()).float()


def _inputs(dtype):
    return (torch.randn(5, 13).to(dtype), torch.randn(1000).to(dtype), torch.randn(3, 5, 7).to(dtype))


def _backward_both(ours, ref, dtype):
    """Ours computes with its low-precision parameters; the reference casts its fp32 weights to
    ``dtype`` in the forward (as autocast does), so its fp32 gradients are the upcast ones."""
    inputs = _inputs(dtype)
    for p in ours + ref:
        p.grad = None
    _loss(ours, inputs).backward()
    _loss([p.to(dtype) for p in ref], inputs).backward()


def _assert_masters_and_rounding(opt, ours, ref, dtype, **tol):
    masters = opt.masters()
    for p, r in zip(ours, ref):
        assert p.dtype == dtype and masters[p].dtype == torch.float32
        torch.testing.assert_close(masters[p], r.detach(), **tol)
        assert torch.equal(p.detach(), masters[p].to(dtype))  # the parameter is the master, rounded


@pytest.mark.parametrize("case", [
    dict(cls=(FusedAdamW, torch.optim.AdamW), kw=dict(lr=1e-2, weight_decay=0.1), dtype=torch.bfloat16),
    dict(cls=(FusedAdamW, torch.optim.AdamW), kw=dict(lr=1e-2, weight_decay=0.0, amsgrad=True), dtype=torch.bfloat16),
    dict(cls=(FusedAdamW, torch.optim.AdamW), kw=dict(lr=5e-3, betas=(0.8, 0.99), maximize=True, weight_decay=0.05),
         dtype=torch.bfloat16),
    dict(cls=(FusedAdam, torch.optim.Adam), kw=dict(lr=1e-2, weight_decay=0.05, amsgrad=True), dtype=torch.bfloat16),
    dict(cls=(FusedAdamW, torch.optim.AdamW), kw=dict(lr=1e-2, weight_decay=0.1), dtype=torch.float16),
    dict(cls=(FusedAdamW, torch.optim.AdamW), kw=dict(lr=1e-2, weight_decay=0.1), dtype=torch.bfloat16,
         lr_tensor=True),
], ids=["adamw", "adamw-amsgrad-no-wd", "adamw-maximize", "adam-l2-amsgrad", "adamw-fp16", "adamw-lr-tensor"])
def test_masters_follow_torch_optim_on_fp32_weights(case):
    ours_cls, torch_cls = case["cls"]
    kw, dtype = case["kw"], case["dtype"]
    ours, ref = _twins()
    lr = torch.tensor(kw["lr"]) if case.get("lr_tensor") else kw["lr"]
    opt = ours_cls(ours, **{**kw, "lr": lr}, master_weights=True, compute_dtype=dtype)
    ref_opt = torch_cls(ref, foreach=False, **kw)
    for p, r in zip(ours, ref):  # the constructor turned the parameters into rounded copies
        assert p.dtype == dtype and torch.equal(p.detach(), r.detach().to(dtype))
    for _ in range(STEPS):
        _backward_both(ours, ref, dtype)
        for p, r in zip(ours, ref):
            assert p.grad.dtype == dtype and torch.equal(p.grad.float(), r.grad)
        opt.step()
        ref_opt.step()
    _assert_masters_and_rounding(opt, ours, ref, dtype)
    for p, r in zip(ours, ref):
        for key, value in ref_opt.state[r].items():
            torch.testing.assert_close(opt.state[p][key], value)


def test_autocast_model_matches_torch_adamw():
    """A model trained on its bf16 weights against the same model in fp32 under CPU autocast."""
    def make():
        return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.ReLU(), torch.nn.Linear(7, 1000))

    model, twin = make(), make()
    twin.load_state_dict(model.state_dict())
    opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
    ref_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(STEPS):
        x = torch.randn(6, 13)
        for m, o in ((model, opt), (twin, ref_opt)):
            o.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = m(x)
            out.float().sin().sum().backward()
            o.step()
    _assert_masters_and_rounding(opt, list(model.parameters()), list(twin.parameters()), torch.bfloat16)
    state = opt.master_state_dict(model)
    assert list(state) == list(twin.state_dict())
    for name, value in twin.state_dict().items():
        assert state[name].dtype == torch.float32
        torch.testing.assert_close(state[name], value)


def test_mixed_groups_and_a_group_added_later():
    ours, ref = _twins()
    opt = FusedAdamW([{"params": ours[:2], "master_weights": True}, {"params": ours[2:3], "weight_decay": 0.0}],
                     lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([{"params": ref[:2]}, {"params": ref[2:3], "weight_decay": 0.0}], lr=1e-2,
                                weight_decay=0.1, foreach=False)
    opt.add_param_group({"params": ours[3:], "master_weights": True, "compute_dtype": torch.float16})
    ref_opt.add_param_group({"params": ref[3:]})
    assert [p.dtype for p in ours] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float16]
    for _ in range(STEPS):
        inputs = _inputs(torch.float32)
        for p in ours + ref:
            p.grad = None
        _loss([p.float() for p in ours], inputs).backward()  # gradients in each parameter's own dtype
        for p, r in zip(ours, ref):
            r.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    masters = opt.masters()
    assert set(masters) == {ours[0], ours[1], ours[3]}
    torch.testing.assert_close(ours[2].detach(), ref[2].detach())
    for i in (0, 1, 3):
        torch.testing.assert_close(masters[ours[i]], ref[i].detach())
        assert torch.equal(ours[i].detach(), masters[ours[i]].to(ours[i].dtype))


def _step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.to(p.dtype)
    opt.step()


def test_state_dict_round_trip_resumes_bit_exactly():
    ours = _fp32_params()
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.1, amsgrad=True, master_weights=True)
    for _ in range(3):
        _step(opt, ours, [torch.randn(s) for s in SHAPES])
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)  # weights_only: the compute dtype in the groups loads too
    assert all(saved["state"][i]["master"].dtype == torch.float32 for i in range(len(SHAPES)))
    assert saved["param_groups"][0]["compute_dtype"] == torch.bfloat16
    resumed = _fp32_params()  # other values: the masters loaded must replace them
    opt2 = FusedAdamW(resumed, lr=1e-2, weight_decay=0.1, amsgrad=True, master_weights=True)
    opt2.load_state_dict(saved)
    for p, q in zip(ours, resumed):
        assert torch.equal(p.detach(), q.detach())  # refreshed from the loaded masters
    for _ in range(3):
        grads = [torch.randn(s) for s in SHAPES]
        _step(opt, ours, grads)
        _step(opt2, resumed, grads)
    for p, q in zip(ours, resumed):
        assert torch.equal(p.detach(), q.detach())
        for key in ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key]), key


def test_loading_torch_adamw_state_keeps_the_masters_and_warns(caplog):
    ours, ref = _twins()
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        grads = [torch.randn(s).to(torch.bfloat16).float() for s in SHAPES]
        _step(ref_opt, ref, grads)
    with torch.no_grad():  # the model's fp32 weights are loaded before the optimizer is built
        for p, r in zip(ours, ref):
            p.copy_(r)
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.1, master_weights=True)
    with caplog.at_level(logging.WARNING, logger="schedlang.optim"):
        opt.load_state_dict(ref_opt.state_dict())
    assert "has no fp32 masters for 4 parameters of master-weights groups; kept the optimizer's current " \
           "masters" in caplog.text
    assert opt.param_groups[0]["master_weights"] is True  # torch's groups do not switch it off
    for p, r in zip(ours, ref):
        assert torch.equal(opt.masters()[p], r.detach())  # fp32 exactly, not rebuilt from bf16
    for _ in range(3):
        grads = [torch.randn(s).to(torch.bfloat16) for s in SHAPES]
        _step(opt, ours, grads)
        _step(ref_opt, ref, [g.float() for g in grads])
    _assert_masters_and_rounding(opt, ours, ref, torch.bfloat16)


def test_cleared_state_rebuilds_masters_from_the_parameters_with_a_warning(caplog):
    ours = _fp32_params(SHAPES[:2])
    opt = FusedAdamW(ours, lr=1e-2, master_weights=True)
    opt.state.clear()
    with caplog.at_level(logging.WARNING, logger="schedlang.optim"):
        _step(opt, ours, [torch.randn(s) for s in SHAPES[:2]])
    assert "a parameter's state has no master; its fp32 master is rebuilt from the torch.bfloat16 parameter " \
           "of shape (7, 13)" in caplog.text
    assert all(torch.equal(p.detach(), w.to(torch.bfloat16)) for p, w in opt.masters().items())


def test_existing_gradients_follow_the_new_dtype():
    p = torch.randn(7, 13, requires_grad=True)
    p.grad = torch.randn(7, 13)
    FusedAdamW([p], master_weights=True)
    assert p.grad.dtype == torch.bfloat16
    (p * 2).sum().backward()  # accumulates into the bf16 gradient
    assert p.grad.dtype == torch.bfloat16


# -- errors -----------------------------------------------------------------------------------

def test_low_precision_parameter_is_refused_and_nothing_changes():
    good, bad = torch.randn(7, 13, requires_grad=True), torch.randn(1000, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ScheduleTypeError, match=r"^FusedAdamW: param group 1 has master_weights=True, but parameter 0 "
                                                r"\(shape \(1000,\)\) has dtype torch\.bfloat16: master weights need "
                                                r"float32 parameters \(the optimizer keeps their fp32 value and turns "
                                                r"them into torch\.bfloat16 copies\); pass float32 parameters or use "
                                                r"master_weights=False$"):
        FusedAdamW([{"params": [good]}, {"params": [bad]}], master_weights=True)
    assert good.dtype == torch.float32  # the first group was not converted either


@pytest.mark.parametrize("kw, error, message", [
    (dict(compute_dtype=torch.float32), ScheduleValueError,
     r"^compute_dtype: must be torch\.bfloat16 or torch\.float16 \(the dtype the model computes with; the masters "
     r"are fp32\), got torch\.float32$"),
    (dict(master_weights="yes"), ScheduleTypeError, r"^master_weights: expected True or False, got 'yes'$"),
])
def test_bad_settings(kw, error, message):
    p = torch.randn(3, requires_grad=True)
    with pytest.raises(error, match=message):
        FusedAdam([p], **kw)
    assert p.dtype == torch.float32


def test_bad_settings_in_a_later_group():
    opt = FusedAdamW([torch.randn(3, requires_grad=True)])
    extra = torch.randn(4, requires_grad=True)
    with pytest.raises(ScheduleValueError, match=r"^compute_dtype: must be .*, got torch\.float64 \(param group 1\)$"):
        opt.add_param_group({"params": [extra], "master_weights": True, "compute_dtype": torch.float64})
    assert len(opt.param_groups) == 1 and extra.dtype == torch.float32


def test_masters_into_a_group_without_master_weights_is_refused():
    ours = _fp32_params(SHAPES[:2])
    opt = FusedAdamW(ours, master_weights=True)
    _step(opt, ours, [torch.randn(s) for s in SHAPES[:2]])
    plain = _fp32_params(SHAPES[:2])
    plain_opt = FusedAdamW(plain)
    before = [p.detach().clone() for p in plain]
    with pytest.raises(ScheduleValueError, match=r"^FusedAdamW\.load_state_dict: the state dict holds an fp32 master "
                                                 r"for parameter 0 of param group 0, but that group has "
                                                 r"master_weights=False; use master_weights=True for this "
                                                 r"group to resume from it$"):
        plain_opt.load_state_dict(opt.state_dict())
    assert len(plain_opt.state) == 0 and all(torch.equal(p.detach(), b) for p, b in zip(plain, before))


def test_master_of_another_shape_is_refused():
    ours = _fp32_params(SHAPES[:2])
    opt = FusedAdamW(ours, master_weights=True)
    state = opt.state_dict()
    state["state"][1] = {"master": torch.randn(999)}
    with pytest.raises(ScheduleValueError, match=r"the master of parameter 1 of param group 0 has shape \(999,\), "
                                                 r"the parameter \(1000,\); a master must match its "
                                                 r"parameter's shape \(was the state dict saved for another "
                                                 r"model\?\)$"):
        opt.load_state_dict(state)


def test_dtensor_parameters_are_refused():
    pytest.importorskip("torch.distributed.tensor")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        d = distribute_tensor(torch.randn(7, 13), mesh, [Shard(0)]).requires_grad_(True)
        with pytest.raises(ScheduleTypeError, match=r"^FusedAdamW: param group 0 has master_weights=True, but "
                                                     r"parameter 1 \(shape \(7, 13\)\) is a DTensor; master weights "
                                                     r"support plain tensors only for now"):
            FusedAdamW([torch.randn(3, requires_grad=True), d], master_weights=True)
    finally:
        if created:
            dist.destroy_process_group()


class _Tied(torch.nn.Module):
    """An embedding, a norm, two Linears (one with a bias) and a head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.up = torch.nn.Linear(6, 13)
        self.down = torch.nn.Linear(13, 6, bias=False)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        return self.head(h + self.down(torch.relu(self.up(h))))


def test_master_weight_groups_take_the_linear_weights_only():
    from schedlang.optim import master_weight_groups

    model = _Tied()
    model.norm.weight.requires_grad_(False)
    groups = master_weight_groups(model, compute_dtype=torch.float16)
    assert [g.get("master_weights", False) for g in groups] == [True, False]
    assert groups[0]["compute_dtype"] == torch.float16
    ids = {id(p) for p in groups[0]["params"]}
    assert ids == {id(model.up.weight), id(model.down.weight)}  # not the tied head, not the bias
    rest = {id(p) for p in groups[1]["params"]}
    assert rest == {id(model.embed.weight), id(model.norm.bias), id(model.up.bias)}  # frozen norm weight left out
    assert master_weight_groups(torch.nn.Embedding(3, 2))[0].get("master_weights") is None  # no empty group


def test_build_with_master_weights_trains_like_autocast_over_fp32_weights():
    """schedlang.build(..., master_weights=True) on a small LLaMA: bf16 Linear weights, fp32 everything else,
    and the losses of torch's AdamW over fp32 weights under autocast."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import schedlang

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=72,
                      vocab_size=97, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    twin = LlamaForCausalLM(cfg)
    twin.load_state_dict(model.state_dict())
    built, opt = schedlang.build(schedlang.create_schedule(model), optimizer="adamw", lr=1e-2, weight_decay=0.01,
                                 master_weights=True)
    ref_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    assert not cfg.tie_word_embeddings  # an untied head is a Linear like the others
    linear = {n for n, m in built.named_modules() if type(m) is torch.nn.Linear}
    assert "lm_head" in linear and len(linear) == 1 + 2 * 7
    for name, p in built.named_parameters():
        owner = name.rpartition(".")[0]
        assert p.dtype == (torch.bfloat16 if owner in linear else torch.float32), name
    ids = torch.randint(0, cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    losses = {}
    for step in range(4):
        for m, o, key in ((built, opt, "master"), (twin, ref_opt, "autocast")):
            o.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses.setdefault(key, []).append(loss.item())
        if step == 0:  # the same forward: autocast's fp32 gradients are the upcast bf16 ones, bit for bit
            twins = dict(twin.named_parameters())
            for name, p in built.named_parameters():
                assert torch.equal(p.grad.float(), twins[name].grad), name
        opt.step()
        ref_opt.step()
        if step == 0:  # one update from identical gradients: the masters are torch's fp32 weights
            masters = opt.master_state_dict(built)
            for name, value in twin.state_dict().items():
                torch.testing.assert_close(masters[name], value, rtol=1e-6, atol=1e-7)
    # later steps drift apart only by the two optimizers' fp32 rounding, which Adam's normalization amplifies
    torch.testing.assert_close(losses["master"], losses["autocast"], rtol=2e-3, atol=0)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"optimizer": "sgd", "master_weights": True}, ScheduleValueError,
     "build: master_weights=True needs optimizer='adamw' or 'adam' (schedlang's fused Adam keeps the fp32 masters), "
     "got optimizer='sgd'"),
    ({"optimizer": "adamw", "master_weights": "yes"}, ScheduleTypeError,
     "build: master_weights must be True or False, got 'yes'"),
])
def test_build_master_weights_errors(kwargs, error, message):
    import schedlang

    model = torch.nn.Linear(4, 3)
    with pytest.raises(error) as info:
        schedlang.build(schedlang.create_schedule(model), **kwargs)
    assert str(info.value) == message
    assert model.weight.dtype == torch.float32


def test_fused_sgd_refuses_master_weights_instead_of_ignoring_them():
    from schedlang.optim import FusedSGD

    p = torch.nn.Parameter(torch.randn(7, 13))
    with pytest.raises(ScheduleValueError, match=r"^master_weights: FusedSGD keeps no fp32 masters; "
                                                 r"use FusedAdamW or FusedAdam for master weights, or drop the "
                                                 r"option$"):
        FusedSGD([{"params": [p], "master_weights": True}], lr=0.1)
    assert p.dtype == torch.float32


def test_gpt2_conv1d_weights_take_master_weights_and_train_like_autocast():
    """GPT-2's Conv1D (a transposed Linear) is what autocast casts there: its weights get masters."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import schedlang
    from schedlang.optim import master_weight_groups

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    twin = GPT2LMHeadModel(cfg)
    twin.load_state_dict(model.state_dict())
    (group, _) = master_weight_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)].split(".", 3)[-1] for p in group["params"]) == sorted(
        ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"] * 2)
    built, opt = schedlang.build(schedlang.create_schedule(model), optimizer="adamw", lr=1e-2, master_weights=True)
    ref_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
    ids = torch.randint(0, cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    for m, o in ((built, opt), (twin, ref_opt)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        o.step()
    masters = opt.master_state_dict(built)
    for name, value in twin.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(masters[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_fused_loss_head_takes_a_master_and_trains_like_autocast():
    """optimize_model's fused linear + cross-entropy head reads its weight only as a matmul operand: its weight
    gets an fp32 master and a bf16 copy like a Linear's (no cast of the vocabulary's weight each step), and the
    first step's gradients are autocast's over fp32 weights, bit for bit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import schedlang
    from schedlang.models import optimize_model
    from schedlang.models.optimize import FusedLinearCrossEntropyHead

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=72,
                      vocab_size=97, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    schedules = []
    for _ in range(2):
        sch = schedlang.create_schedule(model)
        optimize_model(sch, compile=None)
        schedules.append(sch)
    built, opt = schedlang.build(schedules[0], optimizer="adamw", lr=1e-2, master_weights=True)
    twin, ref_opt = schedlang.build(schedules[1], optimizer="adamw", lr=1e-2)
    assert isinstance(built.lm_head, FusedLinearCrossEntropyHead)
    assert built.lm_head.weight.dtype == torch.bfloat16
    assert twin.lm_head.weight.dtype == model.lm_head.weight.dtype == torch.float32  # the user's model untouched
    ids = torch.randint(0, cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    ids[1, 4:] = 5  # repeated labels, and a count of labels (3 x 10) that is not a power of two
    for m in (built, twin):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    twins = dict(twin.named_parameters())
    for name, p in built.named_parameters():
        assert torch.equal(p.grad.float(), twins[name].grad), name
    opt.step()
    ref_opt.step()
    masters = opt.master_state_dict(built)
    for name, value in twin.state_dict().items():
        torch.testing.assert_close(masters[name], value, rtol=1e-6, atol=1e-7, msg=name)

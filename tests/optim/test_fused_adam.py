"""FusedAdamW / FusedAdam against torch.optim on CPU (kernels under the Triton interpreter)."""

import copy
import io

import pytest
import torch

from schedlang.kernels.multi_tensor_adam import reference
from schedlang.optim import FusedAdam, FusedAdamW

from .common import assert_params_close, plain_values, wrapped_twin_params, set_grads, step_side_by_side, twin_params, warm_up_then_copy

STEPS = 12


def _lr_tensor_like(lr, ours_lr_tensor):
    return torch.tensor(lr) if ours_lr_tensor else lr


@pytest.mark.parametrize("case", [
    dict(cls=(FusedAdamW, torch.optim.AdamW), kw=dict(lr=1e-2, weight_decay=0.1), lr_tensor=False),
    dict(cls=(FusedAdamW, torch.optim.AdamW), kw=dict(lr=1e-2, weight_decay=0.1, amsgrad=True), lr_tensor=True),
    dict(cls=(FusedAdamW, torch.optim.AdamW), kw=dict(lr=5e-3, betas=(0.8, 0.99), eps=1e-6, maximize=True),
         lr_tensor=False),
    dict(cls=(FusedAdam, torch.optim.Adam), kw=dict(lr=1e-2, weight_decay=0.05, amsgrad=True), lr_tensor=True),
    dict(cls=(FusedAdam, torch.optim.Adam), kw=dict(lr=1e-2, weight_decay=0.05, maximize=True), lr_tensor=False),
    dict(cls=(FusedAdam, torch.optim.Adam), kw=dict(lr=1e-2, weight_decay=0.05, decoupled_weight_decay=True),
         lr_tensor=False),
], ids=["adamw", "adamw-amsgrad-lrtensor", "adamw-maximize-betas", "adam-l2-amsgrad-lrtensor", "adam-maximize",
        "adam-decoupled"])
def test_matches_torch_optim_with_lr_changes(case):
    ours_cls, torch_cls = case["cls"]
    kw = case["kw"]
    ours, ref = twin_params()
    opt = ours_cls(ours, **{**kw, "lr": _lr_tensor_like(kw["lr"], case["lr_tensor"])})
    ref_opt = torch_cls(ref, foreach=False, **kw)
    for step in range(STEPS):
        if step == 5:  # by hand, mid-run
            for o in (opt, ref_opt):
                lr = o.param_groups[0]["lr"]
                if isinstance(lr, torch.Tensor):
                    lr.fill_(kw["lr"] / 3)
                else:
                    o.param_groups[0]["lr"] = kw["lr"] / 3
        set_grads(ours, ref)
        opt.step()
        ref_opt.step()
    assert_params_close(ours, ref)
    for a, b in zip(ours, ref):
        for key, value in ref_opt.state[b].items():
            torch.testing.assert_close(opt.state[a][key], value.to(torch.float32))
        assert opt.state[a]["step"].dtype == torch.float32 and opt.state[a]["step"].dim() == 0


@pytest.mark.parametrize("lr_tensor", [False, True])
def test_lr_scheduler(lr_tensor):
    ours, ref = twin_params()
    opt = FusedAdamW(ours, lr=_lr_tensor_like(1e-2, lr_tensor), weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (opt, ref_opt)]
    for _ in range(STEPS):
        step_side_by_side(1, (ours, opt), (ref, ref_opt))
        for s in scheds:
            s.step()
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-2 * 0.5**4)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) == lr_tensor
    assert_params_close(ours, ref)


def test_bf16_params_keep_fp32_state_and_match_the_reference():
    """torch.optim on bf16 parameters keeps bf16 state, so the reference here is
    multi_tensor_adam_reference (fp32 maths and state, bf16 write-back), itself checked against
    torch.optim in fp32 by tests/kernels/test_multi_tensor_adam.py."""
    ours, ref = twin_params(torch.bfloat16)
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.1, amsgrad=True)
    ref_m = [torch.zeros(p.shape) for p in ref]
    ref_v = [torch.zeros(p.shape) for p in ref]
    ref_vm = [torch.zeros(p.shape) for p in ref]
    ref_steps = [torch.zeros(()) for _ in ref]
    with torch.no_grad():
        for _ in range(10):
            set_grads(ours, ref)
            opt.step()
            reference(ref, [p.grad for p in ref], ref_m, ref_v, ref_vm, ref_steps, lr=1e-2, beta1=0.9,
                      beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=True, decoupled_weight_decay=True)
    for p, m in zip(ours, ref_m):
        assert p.dtype == torch.bfloat16
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(opt.state[p]["exp_avg"], m, rtol=1e-2, atol=1e-4)
    assert_params_close(ours, ref)  # bf16 tolerances


def test_state_dict_from_torch_loads_into_fused_and_back():
    ours, ref = twin_params()
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, amsgrad=True)
    warm_up_then_copy(ref, ref_opt, ours)
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.1, amsgrad=True)
    opt.load_state_dict(ref_opt.state_dict())
    step_side_by_side(3, (ours, opt), (ref, ref_opt))
    assert_params_close(ours, ref)
    assert float(opt.state[ours[0]]["step"]) == 6.0
    # and back: our state dict (fp32 step tensor, same keys) loads into torch.optim
    again = [p.detach().clone().requires_grad_(True) for p in ours]
    torch_again = torch.optim.AdamW(again, lr=1e-2, weight_decay=0.1, amsgrad=True)
    torch_again.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch.optim aliases what it loads
    assert set(torch_again.state[again[0]]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    step_side_by_side(3, (ours, opt), (again, torch_again))
    assert_params_close(ours, again)


def test_state_dict_round_trip_through_torch_save_keeps_fp32_state_of_bf16_params():
    ours, other = twin_params(torch.bfloat16)
    opt = FusedAdam(ours, lr=1e-2)
    for _ in range(2):
        set_grads(ours)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    with torch.no_grad():
        for a, b in zip(other, ours):
            a.copy_(b)
    opt2 = FusedAdam(other, lr=1e-2)
    opt2.load_state_dict(torch.load(buffer))
    for a, b in zip(ours, other):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert opt2.state[b][key].dtype == torch.float32
            assert torch.equal(opt2.state[b][key], opt.state[a][key])  # not rounded through bf16
            assert opt2.state[b][key].data_ptr() != opt.state[a][key].data_ptr()
    set_grads(ours, other)
    opt.step()
    opt2.step()
    assert_params_close(ours, other, rtol=0, atol=0)


def test_params_without_grads_and_two_groups():
    ours, ref = twin_params()
    groups = lambda ps, lr: [  # noqa: E731
        {"params": ps[:2], "lr": lr, "weight_decay": 0.2, "betas": (0.85, 0.995)},
        {"params": ps[2:], "weight_decay": 0.0, "amsgrad": True}]
    opt = FusedAdamW(groups(ours, torch.tensor(2e-2)), lr=1e-2)
    ref_opt = torch.optim.AdamW(groups(ref, 2e-2), lr=1e-2, foreach=False)
    frozen = ours[3].detach().clone()
    for step in range(8):
        # parameter 3 never gets a gradient; parameter 1 only from step 3 on
        set_grads(ours, ref, skip={3} | ({1} if step < 3 else set()))
        if step == 3:  # a model's zero_grad(set_to_none=True): grads come back as new tensors
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            set_grads(ours, ref, skip={3})
        opt.step()
        ref_opt.step()
    assert_params_close(ours, ref)
    assert torch.equal(ours[3].detach(), frozen) and len(opt.state[ours[3]]) == 0
    assert float(opt.state[ours[1]]["step"]) == 5.0 and float(opt.state[ours[0]]["step"]) == 8.0


def test_state_replaced_by_hand_or_cleared_is_picked_up():
    ours, ref = twin_params()
    opt = FusedAdamW(ours, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    for step in range(6):
        set_grads(ours, ref, in_place=True)  # only the state changes: the launch plan must notice
        if step == 2:
            for o, p in ((opt, ours[1]), (ref_opt, ref[1])):
                o.state[p]["exp_avg"] = torch.full(p.shape, 0.5)
        if step == 4:
            opt.state.clear()
            ref_opt.state.clear()
        opt.step()
        ref_opt.step()
    assert_params_close(ours, ref)


def test_named_parameters_and_non_contiguous_params():
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Linear(7, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Linear(7, 3))
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():  # a transposed (non-contiguous) weight goes through the reference path
        model[0].weight = torch.nn.Parameter(model[0].weight.detach().t().contiguous().t())
    opt = FusedAdamW(model.named_parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
    x = torch.randn(5, 13)
    for _ in range(4):
        for m, o in ((model, opt), (twin, ref_opt)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    assert not model[0].weight.is_contiguous()
    assert_params_close(list(model.parameters()), list(twin.parameters()))
    assert opt.state_dict()["param_groups"][0]["param_names"][0] == "0.weight"


def test_parameters_of_a_tensor_subclass_are_updated_through_the_reference():
    """A subclass holding its values elsewhere (``data_ptr()`` 0) beside plain parameters in one group: the
    kernel takes the plain ones, the subclass goes through the reference, and both match torch.optim."""
    ours, ref = wrapped_twin_params()
    assert ours[0].data_ptr() == 0
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, foreach=False, lr=1e-2, weight_decay=0.1)
    step_side_by_side(4, (ours, opt), (ref, ref_opt))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(plain_values(a), b.detach())


def test_torchao_float8_weights_are_updated_in_place_through_the_tensor_they_wrap():
    """FSDP2's float8 all-gather keeps each float8 weight as torchao's wrapper (``data_ptr()`` 0): the kernel
    updates the wrapped tensor, the wrapper stays the parameter, and the values match torch.optim's."""
    fsdp_utils = pytest.importorskip("torchao.float8.fsdp_utils", reason="torchao not installed")
    from torchao.float8.float8_training_tensor import LinearMMConfig

    from schedlang.kernels.multi_tensor_apply import is_dense
    from schedlang.optim.base import local_tensor

    ours, ref = twin_params()
    inner = [p.detach().clone() for p in ours[:2]]
    ours[:2] = [torch.nn.Parameter(fsdp_utils.WeightWithDynamicFloat8CastTensor(t, LinearMMConfig(), torch.float8_e4m3fn))
                for t in inner]
    assert ours[0].data_ptr() == 0 and local_tensor(ours[0]) is inner[0] and is_dense(local_tensor(ours[0]))
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    step_side_by_side(4, (ours, opt), (ref, ref_opt))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(local_tensor(a), b.detach())
    assert all(local_tensor(a) is t for a, t in zip(ours[:2], inner))  # the wrapped tensors, updated in place
    assert all(type(a).__name__ == "WeightWithDynamicFloat8CastTensor" for a in ours[:2])

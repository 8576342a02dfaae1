"""FusedSGD against torch.optim.SGD on CPU (kernels under the Triton interpreter)."""

import copy

import pytest
import torch

from schedlang.kernels.multi_tensor_sgd import reference
from schedlang.optim import FusedSGD

from .common import assert_params_close, plain_values, wrapped_twin_params, set_grads, step_side_by_side, twin_params, warm_up_then_copy


@pytest.mark.parametrize("kw", [
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
    dict(lr=0.05, momentum=0.8, dampening=0.3, maximize=True),
    dict(lr=0.05, weight_decay=0.01),
], ids=["nesterov-wd", "dampening-maximize", "plain"])
@pytest.mark.parametrize("lr_tensor", [False, True])
def test_matches_torch_optim(kw, lr_tensor):
    ours, ref = twin_params()
    opt = FusedSGD(ours, **{**kw, "lr": torch.tensor(kw["lr"]) if lr_tensor else kw["lr"]})
    ref_opt = torch.optim.SGD(ref, foreach=False, **kw)
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8) for o in (opt, ref_opt)]
    for step in range(12):
        # a parameter without a gradient at first, then with one (its buffer starts late)
        set_grads(ours, ref, skip={2} if step < 4 else set())
        opt.step()
        ref_opt.step()
        for s in scheds:
            s.step()
    assert_params_close(ours, ref)
    if kw.get("momentum"):
        for a, b in zip(ours, ref):
            torch.testing.assert_close(opt.state[a]["momentum_buffer"], ref_opt.state[b]["momentum_buffer"])
    else:
        assert len(opt.state) == 0


def test_bf16_params_match_the_reference():
    ours, ref = twin_params(torch.bfloat16)
    opt = FusedSGD(ours, lr=0.05, momentum=0.9, weight_decay=0.1)
    buffers = [torch.empty(p.shape) for p in ref]
    with torch.no_grad():
        for step in range(10):
            set_grads(ours, ref)
            opt.step()
            reference(ref, [p.grad for p in ref], buffers, [step == 0] * len(ref), lr=0.05, momentum=0.9,
                      dampening=0.0, weight_decay=0.1)
    for p, b in zip(ours, buffers):
        assert opt.state[p]["momentum_buffer"].dtype == torch.float32
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], b, rtol=1e-2, atol=1e-3)
    assert_params_close(ours, ref)


def test_state_dict_round_trips_with_torch():
    ours, ref = twin_params()
    kw = dict(lr=0.05, momentum=0.9, nesterov=True)
    ref_opt = torch.optim.SGD(ref, **kw)
    warm_up_then_copy(ref, ref_opt, ours)
    opt = FusedSGD(ours, **kw)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    step_side_by_side(3, (ours, opt), (ref, ref_opt))
    assert_params_close(ours, ref)
    back = [p.detach().clone().requires_grad_(True) for p in ours]
    back_opt = torch.optim.SGD(back, **kw)
    back_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    step_side_by_side(2, (ours, opt), (back, back_opt))
    assert_params_close(ours, back)


def test_parameters_of_a_tensor_subclass_are_updated_through_the_reference():
    """A subclass holding its values elsewhere (``data_ptr()`` 0) beside plain parameters in one group: the
    kernel takes the plain ones, the subclass goes through the reference, and both match torch.optim."""
    ours, ref = wrapped_twin_params()
    assert ours[0].data_ptr() == 0
    opt = FusedSGD(ours, lr=0.05, momentum=0.9, weight_decay=0.1)
    ref_opt = torch.optim.SGD(ref, foreach=False, lr=0.05, momentum=0.9, weight_decay=0.1)
    step_side_by_side(4, (ours, opt), (ref, ref_opt))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(plain_values(a), b.detach())

"""Bad arguments and inputs: torch.optim's kind of messages, as ScheduleValueError/TypeError."""

import pytest
import torch

from schedlang.errors import ScheduleTypeError, ScheduleValueError
from schedlang.optim import FusedAdam, FusedAdamW, FusedSGD, make_optimizer


def _params():
    return [torch.randn(7, 13, requires_grad=True), torch.randn(5, requires_grad=True)]


@pytest.mark.parametrize("cls", [FusedAdamW, FusedAdam])
@pytest.mark.parametrize("kw, message", [
    (dict(lr=-0.1), r"^Invalid learning rate: -0\.1: must be >= 0$"),
    (dict(lr=torch.tensor([1e-3, 1e-3])), r"^Tensor lr must be 1-element, got shape \(2,\)$"),
    (dict(betas=(1.0, 0.999)), r"^Invalid beta parameter at index 0: 1\.0: must be in \[0, 1\)$"),
    (dict(betas=(0.9, -0.1)), r"^Invalid beta parameter at index 1: -0\.1"),
    (dict(eps=-1e-8), r"^Invalid epsilon value: -1e-08"),
    (dict(weight_decay=-0.5), r"^Invalid weight_decay value: -0\.5"),
    (dict(differentiable=True), r"does not support differentiable=True.*use torch\.optim\.Adam"),
])
def test_adam_arguments(cls, kw, message):
    with pytest.raises(ScheduleValueError, match=message):
        cls(_params(), **kw)


@pytest.mark.parametrize("kw, message", [
    (dict(lr=-1.0), r"^Invalid learning rate: -1\.0"),
    (dict(momentum=-0.5), r"^Invalid momentum value: -0\.5"),
    (dict(weight_decay=-1e-4), r"^Invalid weight_decay value: -0\.0001"),
    (dict(nesterov=True), r"^Nesterov momentum requires a momentum and zero dampening: got momentum=0\.0"),
    (dict(nesterov=True, momentum=0.9, dampening=0.1), r"requires a momentum and zero dampening: .*dampening=0\.1"),
])
def test_sgd_arguments(kw, message):
    with pytest.raises(ScheduleValueError, match=message):
        FusedSGD(_params(), **kw)


def test_errors_are_value_errors_like_torch():
    with pytest.raises(ValueError, match="Invalid learning rate"):
        FusedAdamW(_params(), lr=-1.0)


def test_bad_group_is_refused_whole():
    opt = FusedAdamW(_params(), lr=1e-3)
    extra = torch.randn(3, requires_grad=True)
    with pytest.raises(ScheduleValueError, match=r"^Invalid learning rate: -1\.0 \(param group 1\)"):
        opt.add_param_group({"params": [extra], "lr": -1.0})
    with pytest.raises(ScheduleValueError, match=r"Invalid beta parameter at index 0: 2\.0 \(param group 1\)"):
        opt.add_param_group({"params": [extra], "betas": (2.0, 0.9)})
    assert len(opt.param_groups) == 1


def test_unsupported_dtypes():
    with pytest.raises(ScheduleTypeError, match=r"parameter 1 has dtype torch\.float64; the fused kernels update "
                                                r"only float32, bfloat16, float16 parameters"):
        FusedAdamW([torch.randn(3, requires_grad=True), torch.randn(3, dtype=torch.float64, requires_grad=True)])


def test_sparse_gradients_are_refused_before_anything_changes():
    dense, emb = torch.randn(4, requires_grad=True), torch.randn(10, 3, requires_grad=True)
    opt = FusedAdamW([dense, emb], lr=1e-2)
    dense.grad = torch.randn(4)
    emb.grad = torch.sparse_coo_tensor(torch.tensor([[1, 4]]), torch.randn(2, 3), (10, 3), check_invariants=True)
    before = dense.detach().clone()
    with pytest.raises(ScheduleValueError, match=r"FusedAdamW: sparse gradients are not supported \(parameter 1 of "
                                                 r"param group 0 has a torch.sparse_coo gradient\)"):
        opt.step()
    assert torch.equal(dense.detach(), before) and len(opt.state) == 0


def test_sparse_gradient_after_some_steps():
    p = torch.randn(10, 3, requires_grad=True)
    opt = FusedSGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.randn(10, 3)
    opt.step()
    p.grad = p.grad.to_sparse()
    with pytest.raises(ScheduleValueError, match="FusedSGD: sparse gradients are not supported"):
        opt.step()


def test_make_optimizer_by_name():
    opt = make_optimizer("AdamW", _params(), lr=3e-4, weight_decay=0.1)
    assert type(opt) is FusedAdamW and opt.param_groups[0]["lr"] == 3e-4
    assert type(make_optimizer("adam", _params())) is FusedAdam
    sgd = make_optimizer("SGD", _params(), lr=0.1, momentum=0.9, nesterov=True)
    assert type(sgd) is FusedSGD and sgd.param_groups[0]["nesterov"]
    with pytest.raises(ScheduleValueError, match=r"^make_optimizer: unknown optimizer 'lamb': valid names are 'adamw', 'adam', 'sgd'$"):
        make_optimizer("lamb", _params())
    with pytest.raises(ScheduleValueError, match=r"unknown optimizer None"):
        make_optimizer(None, _params())


@pytest.mark.parametrize("cls", [FusedAdamW, FusedAdam, FusedSGD])
@pytest.mark.parametrize("params, message", [
    ([], r"params is empty: pass the tensors to update"),
    (iter([]), r"params is empty: pass the tensors to update"),
    (5, r"params must be an iterable of tensors or param-group dicts \(e\.g\. model\.parameters\(\)\), got int$"),
    (torch.zeros(3), r"params must be an iterable of tensors or param-group dicts, got one tensor of shape \(3,\); "
                     r"pass a list of it"),
], ids=["empty list", "empty generator", "int", "one tensor"])
def test_params_that_are_no_parameter_list(cls, params, message):
    with pytest.raises(ScheduleValueError, match=rf"^{cls.__name__}: {message}"):
        cls(params, lr=0.1)


def test_a_generator_of_parameters_is_still_taken_whole():
    params = _params()
    opt = FusedAdamW(p for p in params)
    assert opt.param_groups[0]["params"] == params


def test_make_optimizer_names_an_unknown_option_and_the_valid_ones():
    with pytest.raises(ScheduleValueError, match=r"^make_optimizer: 'sgd' \(FusedSGD\) has no option 'foo': valid "
                                                 r"options are lr, momentum, dampening, weight_decay, nesterov"):
        make_optimizer("sgd", _params(), lr=0.1, foo=1)


def test_master_weight_groups_takes_a_model():
    from schedlang.optim import master_weight_groups

    with pytest.raises(ScheduleValueError, match=r"^master_weight_groups: model must be a torch.nn.Module .*got int$"):
        master_weight_groups(5)


@pytest.mark.parametrize("make", [lambda ps: FusedAdamW(ps), lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9)],
                         ids=["adamw", "sgd"])
def test_a_state_dict_of_another_models_shapes_is_refused_before_anything_is_loaded(make):
    """The kernels would read and write such a state past its end."""
    small, big = torch.nn.Linear(4, 4), torch.nn.Linear(4, 5)
    saved_opt = make(list(small.parameters()))
    small(torch.randn(2, 4)).sum().backward()
    saved_opt.step()
    opt = make(list(big.parameters()))
    before = opt.state_dict()
    with pytest.raises(ScheduleValueError, match=r"load_state_dict: state '(exp_avg|momentum_buffer)' of parameter 0 "
                                                 r"of param group 0 has shape \(4, 4\), the parameter \(5, 4\)"):
        opt.load_state_dict(saved_opt.state_dict())
    assert opt.state_dict()["state"] == before["state"]

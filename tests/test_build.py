import pytest
import torch
from torch import nn

import schedlang
from tests.helpers.models import MLP


def test_build_returns_scheduled_model_and_no_optimizer_by_default():
    sch = schedlang.create_schedule(MLP())
    sch["fc1"].decompose()
    model, opt = schedlang.build(sch)
    assert model is sch.mod and opt is None


def test_build_with_an_optimizer_class_and_dtype():
    sch = schedlang.create_schedule(MLP())
    model, opt = schedlang.build(sch, optimizer=torch.optim.SGD, lr=0.1, dtype=torch.float64)
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["lr"] == 0.1
    assert model.fc1.weight.dtype == torch.float64


def test_build_init_weights_callable_applies_to_every_module():
    sch = schedlang.create_schedule(MLP())

    def zero_bias(m):
        if isinstance(m, nn.Linear):
            m.bias.fill_(0.5)

    model, _ = schedlang.build(sch, init_weights=zero_bias)
    assert torch.all(model.fc1.bias == 0.5) and torch.all(model.fc2.bias == 0.5)


def test_build_materializes_meta_model_with_equal_values_for_the_same_seed():
    with schedlang.init_empty_weights():
        meta = MLP(7, 13)
    assert meta.fc1.weight.is_meta
    sch = schedlang.create_schedule(meta)
    sch["fc1"].shard("weight", axis=0)
    torch.manual_seed(5)
    model, _ = schedlang.build(sch, device="cpu")
    assert not any(p.is_meta for p in model.parameters())
    with schedlang.init_empty_weights():
        full = MLP(7, 13)
    torch.manual_seed(5)
    full, _ = schedlang.build(schedlang.create_schedule(full), device="cpu")
    torch.testing.assert_close(model.fc1.weight, full.fc1.weight)  # world size 1: the shard is everything
    torch.testing.assert_close(model.fc2.bias, full.fc2.bias)
    x = torch.randn(2, 7)
    torch.testing.assert_close(model(x), full(x))


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(init_weights="yes"), schedlang.ScheduleTypeError, r"init_weights must be None, a bool or a callable"),
    (dict(lr=0.1), schedlang.ScheduleValueError, r"optimizer options \['lr'\] given without optimizer="),
    (dict(optimizer=3), schedlang.ScheduleTypeError, r"optimizer must be a name \('adamw', 'adam', 'sgd'\) or a "
                                                     r"torch.optim.Optimizer class, got 3"),
])
def test_build_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        schedlang.build(schedlang.create_schedule(MLP()), **kwargs)

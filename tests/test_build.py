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


def test_build_takes_a_schedule_not_a_model():
    with pytest.raises(schedlang.ScheduleValueError, match=r"^build: sch must be a schedlang.Schedule, got MLP; wrap "
                                                          r"the model first: sch = schedlang.create_schedule\(model\)$"):
        schedlang.build(MLP())


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(init_weights="yes"), schedlang.ScheduleTypeError, r"init_weights must be None, a bool or a callable"),
    (dict(lr=0.1), schedlang.ScheduleValueError, r"optimizer options \['lr'\] given without optimizer="),
    (dict(optimizer=3), schedlang.ScheduleTypeError, r"optimizer must be a name \('adamw', 'adam', 'sgd'\) or a "
                                                     r"torch.optim.Optimizer class, got 3"),
])
def test_build_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        schedlang.build(schedlang.create_schedule(MLP()), **kwargs)


# build is all-or-nothing: every argument is checked before anything is cast, moved or initialized

_BAD_ARGUMENTS = [
    (dict(optimizer="lamb", lr=0.1, dtype=torch.float64), schedlang.ScheduleValueError,
     r"^build: unknown optimizer 'lamb': valid names are 'adamw', 'adam', 'sgd', or pass a torch.optim.Optimizer "
     r"class$"),
    (dict(optimizer="adamw", lr=-1.0, dtype=torch.float64), schedlang.ScheduleValueError,
     r"^build: optimizer 'adamw' rejects its options \{'lr': -1.0\}: "),
    (dict(optimizer=torch.optim.SGD, lr=0.1, momentun=0.9, dtype=torch.float64), schedlang.ScheduleTypeError,
     r"^build: optimizer 'SGD' rejects its options \{'lr': 0.1, 'momentun': 0.9\}: .*momentun"),
    (dict(optimizer="sgd", lr=0.1, dtype=torch.float64), schedlang.ScheduleTypeError,
     r"^build: optimizer 'sgd' rejects its options \{'lr': 0.1\}: FusedSGD: parameter 0 has dtype torch.float64; the "
     r"fused kernels update only float32, bfloat16, float16 parameters$"),
    (dict(optimizer="sgd", lr=0.1, dtype=torch.int32), schedlang.ScheduleValueError,
     r"^build: dtype torch.int32 is not a floating-point dtype; pass one of torch.float32, "
     r"torch.bfloat16, torch.float16 or torch.float64$"),
    (dict(optimizer="sgd", lr=0.1, dtype="float16"), schedlang.ScheduleTypeError,
     r"^build: dtype must be a torch.dtype such as torch.bfloat16, got 'float16'$"),
    (dict(optimizer="sgd", lr=0.1, dtype=torch.float64, device="gpu0"), schedlang.ScheduleValueError,
     r"^build: device 'gpu0' is not a device: valid are 'cpu', 'cuda', 'cuda:N', 'meta' or a torch.device$"),
    (dict(optimizer="sgd", lr=0.1, dtype=torch.float64, device="cuda:64"), schedlang.ScheduleValueError,
     r"^build: device 'cuda:64' (asks for CUDA, but no CUDA device is available; use device='cpu'|does not exist: "
     r"valid CUDA indices are 0\.\.\d+)$"),
    (dict(device=[0]), schedlang.ScheduleTypeError,
     r"^build: device must be a string such as 'cpu' or 'cuda:0', a torch.device or a GPU index, got \[0\]$"),
]


@pytest.mark.parametrize("kwargs,error,message", _BAD_ARGUMENTS)
def test_build_checks_every_argument_before_it_changes_anything(kwargs, error, message):
    from tests.helpers.models import assert_unchanged, state_snapshot

    original = MLP(7, 13)
    user_model = state_snapshot(original)
    sch = schedlang.create_schedule(original)
    sch["fc1"].shard("weight", axis=0)
    sch["fc2"].decompose()
    plan = sch.plan.to_json()
    scheduled = state_snapshot(sch.mod)
    with pytest.raises(error, match=message):
        schedlang.build(sch, init_weights=lambda m: [p.data.fill_(3.0) for p in m.parameters(recurse=False)],
                        **kwargs)
    assert_unchanged(sch.mod, scheduled)  # not cast, not moved, not re-initialized
    assert_unchanged(original, user_model)
    assert sch.plan.to_json() == plan
    # a correct build afterwards works
    model, opt = schedlang.build(sch, optimizer=torch.optim.SGD, lr=0.1, dtype=torch.float64)
    assert model.fc1.weight.dtype == torch.float64 and isinstance(opt, torch.optim.SGD)
    x = torch.randn(5, 7, dtype=torch.float64)
    torch.testing.assert_close(model(x), original.double()(x))


def test_build_of_a_meta_model_with_a_bad_optimizer_allocates_nothing():
    with schedlang.init_empty_weights():
        meta = MLP(7, 13)
    sch = schedlang.create_schedule(meta)
    with pytest.raises(schedlang.ScheduleValueError, match=r"^build: unknown optimizer 'adamx'"):
        schedlang.build(sch, optimizer="adamx")
    assert all(p.is_meta for p in sch.mod.parameters())
    model, _ = schedlang.build(sch, optimizer="adamw", device="cpu")
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("late_step", [
    lambda sch: sch["fc1"].replace(nn.Linear(12, 20)),
    lambda sch: sch["fc2"].checkpoint(),
    lambda sch: sch.trace(),
])
def test_a_primitive_after_build_is_refused_and_the_built_model_is_unchanged(late_step):
    """The built model is the schedule's own: a primitive now would change it behind its optimizer."""
    sch = schedlang.create_schedule(MLP())
    model, opt = schedlang.build(sch, optimizer=torch.optim.SGD, lr=0.1)
    before = {name: type(m) for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan_length = len(sch.plan)
    with pytest.raises(schedlang.errors.ScheduleValueError, match="after build") as info:
        late_step(sch)
    assert "create_schedule" in str(info.value)
    assert {name: type(m) for name, m in model.named_modules()} == before and len(sch.plan) == plan_length
    assert "forward" not in vars(model.fc2)  # checkpoint sets an instance forward; nothing was set
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}

"""``Schedule.horizontal_fuse`` as a primitive: on a schedule, recorded, replayable, errors."""

import inspect

import pytest
import torch
from torch import fx, nn

import schedlang
from schedlang.primitives.base import get_primitive
from schedlang.primitives.horizontal_fuse import HorizontalFuse
from tests.graph.passes.models import ParallelBranches, SplitLayerNormTanhCat, count_calls, randomize


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = ParallelBranches(n=4, d_in=6, d=5, concat=True)
        self.features = SplitLayerNormTanhCat(n=4, d=5)

    def forward(self, x):
        return self.features(self.heads(x))


def _schedule_with_traced_heads(model):
    sch = schedlang.create_schedule(model)
    sch["heads"]._set_module(fx.symbolic_trace(sch["heads"].mod))  # what sch["heads"].trace() does
    return sch


def _call(sch, **kwargs):
    # always through the Schedule method: a missing or miswired method fails every test here
    return sch.horizontal_fuse(**kwargs)


def test_fuses_the_traced_submodule_and_records_a_step():
    model = randomize(Model())
    sch = _schedule_with_traced_heads(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = _call(sch["heads"])
    assert report.path == "heads" and str(report).startswith("horizontal_fuse at 'heads': 5 rewrite(s)")
    assert count_calls(sch["heads"].mod) == {"linear": 1, "unflatten": 1, "group_layer_norm": 1, "relu": 1,
                                             "flatten": 1}
    step = sch.plan[-1]
    assert (step.primitive, step.path, step.args) == ("horizontal_fuse", "heads", {"rules": None, "min_group_size": 2})
    x = torch.randn(7, 6)
    torch.testing.assert_close(sch.mod(x), model(x))
    for k, v in model.state_dict().items():  # the user's model is untouched
        assert torch.equal(v, before[k])


def test_the_plan_replays_from_json():
    model = randomize(SplitLayerNormTanhCat(n=3, d=4))
    sch = schedlang.create_schedule(fx.symbolic_trace(model))
    _call(sch, rules=["layer_norm", "activation", "stack_unbind", "cat_unbind"])
    text = sch.plan.to_json()
    again = schedlang.replay(text, fx.symbolic_trace(model))
    assert again.mod.code == sch.mod.code
    x = torch.randn(5, 12)
    torch.testing.assert_close(again.mod(x), model(x))


def test_verify_accepts_a_fused_schedule():
    model = randomize(Model())
    sch = schedlang.create_schedule(fx.symbolic_trace(model))
    with schedlang.Verify(sch, example_inputs=[torch.randn(3, 6)]):
        _call(sch)


def test_an_untraced_module_is_refused():
    sch = schedlang.create_schedule(Model())
    with pytest.raises(schedlang.NotTracedError,
                       match=r'^heads: horizontal_fuse needs a traced module, but this is ParallelBranches; call '
                             r'sch\["heads"\]\.trace\(\) first$'):
        _call(sch["heads"])
    with pytest.raises(schedlang.NotTracedError, match=r"^<root>: horizontal_fuse needs a traced module, but this "
                                                       r"is Model; call sch\.trace\(\) first$"):
        _call(sch)
    assert len(sch.plan) == 0


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(rules=["layer_norm", "nope"]), schedlang.ScheduleValueError,
     r"^heads: unknown horizontal fusion rule 'nope': valid rules are linear_same_input, linear_batched, "
     r"layer_norm, activation, split_cat, stack_unbind, cat_unbind, embedding_bags$"),
    (dict(rules="layer_norm"), schedlang.ScheduleTypeError,
     r"^heads: horizontal_fuse rules must be None or a list of rule names, got 'layer_norm'; valid rules are "
     r"linear_same_input, "),
    (dict(min_group_size=1), schedlang.ScheduleValueError,
     r"^heads: horizontal_fuse min_group_size must be an int >= 2, got 1$"),
    (dict(min_group_size="2"), schedlang.ScheduleValueError,
     r"^heads: horizontal_fuse min_group_size must be an int >= 2, got '2'$"),
])
def test_bad_arguments_change_nothing(kwargs, error, message):
    sch = _schedule_with_traced_heads(Model())
    code = sch["heads"].mod.code
    with pytest.raises(error, match=message):
        _call(sch["heads"], **kwargs)
    assert len(sch.plan) == 0 and sch["heads"].mod.code == code


def test_registered_under_its_name():
    assert "horizontal_fuse" in schedlang.list_primitives()
    # the registry holds the primitive this package defines (not some other class under that name)
    assert get_primitive("horizontal_fuse") is HorizontalFuse
    # and the Schedule method takes the same arguments that the step records
    method = inspect.signature(schedlang.Schedule.horizontal_fuse)
    assert list(method.parameters) == ["self", "rules", "min_group_size"]
    sch = _schedule_with_traced_heads(randomize(Model()))
    sch["heads"].horizontal_fuse(rules=["linear_same_input"], min_group_size=3)
    step = sch.plan[-1]
    assert (step.primitive, step.path, step.args) == ("horizontal_fuse", "heads",
                                                      {"rules": ["linear_same_input"], "min_group_size": 3})

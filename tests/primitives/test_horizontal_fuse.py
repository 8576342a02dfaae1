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
    assert (step.primitive, step.path, step.args) == ("horizontal_fuse", "heads", {"rules": None, "min_group_size": 2,
                                                                                   "example_inputs": None})
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
    (dict(example_inputs=torch.randn(3, 6)), schedlang.ScheduleTypeError,
     r"^heads: horizontal_fuse example_inputs must be None or a list of tensors, got tensor\("),
    (dict(example_inputs=[torch.randn(3, 6), "x"]), schedlang.ScheduleTypeError,
     r"^heads: horizontal_fuse example_inputs must be None or a list of tensors, got \[tensor\("),
    (dict(example_inputs=[]), schedlang.ScheduleValueError,
     r"^heads: horizontal_fuse example_inputs has 0 tensor\(s\), but the traced forward takes 1 \(x\); pass one "
     r"tensor per input$"),
    (dict(example_inputs=[torch.randn(3, 7)]), schedlang.ScheduleValueError,
     r"^heads: horizontal_fuse cannot run the traced graph on example_inputs \[\(3, 7\) float32\] at node "
     r"'linears_0': RuntimeError: .+; pass tensors shaped as in a real call of forward \(x\)$"),
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
    assert list(method.parameters) == ["self", "rules", "min_group_size", "example_inputs"]
    sch = _schedule_with_traced_heads(randomize(Model()))
    sch["heads"].horizontal_fuse(rules=["linear_same_input"], min_group_size=3)
    step = sch.plan[-1]
    assert (step.primitive, step.path, step.args) == ("horizontal_fuse", "heads",
                                                      {"rules": ["linear_same_input"], "min_group_size": 3,
                                                       "example_inputs": None})


class EmbeddingFeatures(nn.Module):
    """Seed case 1 behind a linear: ``torch.split(x, 13, dim=1)``, LayerNorm + tanh per piece, cat."""

    def __init__(self, n=7, d=13):
        super().__init__()
        self.n, self.d = n, d
        self.proj = nn.Linear(5, n * d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))

    def forward(self, x):
        pieces = torch.split(self.proj(x), self.d, dim=1)
        return torch.cat([torch.tanh(self.norms[i](pieces[i])) for i in range(self.n)], 1)


@pytest.mark.parametrize("with_examples", [False, True])
def test_every_branch_fuses_after_sch_trace_with_or_without_example_inputs(with_examples):
    model = randomize(EmbeddingFeatures())
    sch = schedlang.create_schedule(model)
    sch.trace()
    examples = [torch.randn(4, 5)] if with_examples else None
    report = _call(sch, example_inputs=examples)
    by_rule = {r.rule: r for r in report.records}
    assert len(by_rule["layer_norm"].members) == 7 and len(by_rule["activation"].members) == 7
    calls = count_calls(sch.mod)
    assert "LayerNorm" not in calls and calls["group_layer_norm" if with_examples else "piecewise_layer_norm"] == 1
    x = torch.randn(3, 5)
    torch.testing.assert_close(sch.mod(x), model(x))
    if with_examples:  # recorded as shapes and dtypes, shown so in the plan, replayed from JSON
        step = sch.plan[-1]
        assert [(tuple(t.shape), t.dtype, t.device.type) for t in step.args["example_inputs"]] == \
            [((4, 5), torch.float32, "meta")]
        assert "example_inputs=[(4, 5) float32]" in str(sch.plan)
        again = schedlang.replay(sch.plan.to_json(), model)
        assert again.mod.code == sch.mod.code


def test_example_inputs_in_a_plan_must_be_shapes_and_dtypes():
    model = randomize(EmbeddingFeatures(n=2, d=3))
    sch = schedlang.create_schedule(model)
    sch.trace()
    _call(sch, example_inputs=[torch.randn(4, 5)])
    text = sch.plan.to_json().replace('"dtype": "float32"', '"dtype": "floaty"')
    with pytest.raises(schedlang.PlanSerializationError,
                       match=r"^step 1 \(horizontal_fuse at '<root>'\), argument 'example_inputs': each example input "
                             r"must be \{\"shape\": \[ints >= 0\], \"dtype\": \"float32\" \(a torch dtype\)\}, got "
                             r"\{'shape': \[4, 5\], 'dtype': 'floaty'\}$"):
        schedlang.replay(text, model)

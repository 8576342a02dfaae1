import pytest
import torch
from torch import nn

import schedlang
from tests.helpers.models import Stack


class TanhGELU(nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x, approximate="tanh")


def test_replace_all_replaces_every_match_and_reports_paths():
    model = Stack(layers=3)
    sch = schedlang.create_schedule(model)
    seen = []

    def make(path, old):
        seen.append((path, type(old).__name__))
        return TanhGELU()

    replaced = sch.replace_all(nn.GELU, make)
    assert replaced == ["layers.0.mlp.act", "layers.1.mlp.act", "layers.2.mlp.act"]
    assert seen == [(p, "GELU") for p in replaced]
    assert all(isinstance(sch[p].mod, TanhGELU) for p in replaced)
    x = torch.randn(4, 12)
    model.eval(); sch.mod.eval()
    torch.testing.assert_close(sch.mod(x), model(x), rtol=1e-2, atol=1e-3)


def test_replace_all_under_a_subtree_only():
    sch = schedlang.create_schedule(Stack())
    assert sch["layers.1"].replace_all(nn.Linear, lambda p, old: old) == ["mlp.fc1", "mlp.fc2"]
    assert sch.plan[0].path == "layers.1"


def test_replace_all_is_atomic_and_validates():
    sch = schedlang.create_schedule(Stack())
    calls = []

    def bad(path, old):
        calls.append(path)
        return "not a module" if len(calls) == 2 else nn.Identity()

    with pytest.raises(schedlang.ScheduleTypeError, match=r"<root>: make_fn returned str for 'layers.1.mlp.act'"):
        sch.replace_all(nn.GELU, bad)
    assert isinstance(sch["layers.0.mlp.act"].mod, nn.GELU)  # nothing applied
    with pytest.raises(schedlang.ScheduleValueError, match=r"^<root>: no submodule of type Conv2d to replace; pass a module type that occurs in the model$"):
        sch.replace_all(nn.Conv2d, lambda p, o: o)
    with pytest.raises(schedlang.ScheduleTypeError, match=r"expects an nn.Module subclass as module_type, got 3"):
        sch.replace_all(3, lambda p, o: o)
    with pytest.raises(schedlang.ScheduleTypeError, match=r"expects make_fn\(path, old_module\) -> nn.Module, got int"):
        sch.replace_all(nn.GELU, 3)


@pytest.mark.parametrize("make_fn, args, kwargs, message", [
    (lambda old: old, (), {}, r"^<root>: replace_all make_fn\(old\) cannot be called with \(path, old_module\): too many "
                              r"positional arguments; give a function that takes \(path, old_module\)$"),
    (lambda path, old: old, (7,), {}, r"make_fn\(path, old\) cannot be called with \(path, old_module, 1 more "
                                      r"positional argument\(s\)\)"),
    (lambda path, old, *, scale: old, (), {"shift": 1}, r"cannot be called with \(path, old_module, keyword "
                                                        r"argument\(s\) shift\): missing a required argument: 'scale'"),
], ids=["one argument", "extra positional", "unknown keyword"])
def test_make_fn_of_the_wrong_arity_is_refused_before_any_call(make_fn, args, kwargs, message):
    sch = schedlang.create_schedule(Stack())
    with pytest.raises(schedlang.ScheduleValueError, match=message):
        sch.replace_all(nn.GELU, make_fn, *args, **kwargs)
    assert len(sch.plan) == 0 and isinstance(sch["layers.0.mlp.act"].mod, nn.GELU)


def test_a_failing_make_fn_names_the_module_and_changes_nothing():
    sch = schedlang.create_schedule(Stack())

    def make(path, old):
        if path.startswith("layers.1"):
            raise RuntimeError("no fused kernel for this shape")
        return TanhGELU()

    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"^<root>: replace_all make_fn raised RuntimeError for 'layers.1.mlp.act' \(GELU\): no "
                             r"fused kernel for this shape; nothing was replaced; fix make_fn so that it returns an "
                             r"nn.Module for every GELU$") as caught:
        sch.replace_all(nn.GELU, make)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert len(sch.plan) == 0 and isinstance(sch["layers.0.mlp.act"].mod, nn.GELU)
    assert sch.replace_all(nn.GELU, lambda path, old: TanhGELU()) == ["layers.0.mlp.act", "layers.1.mlp.act"]


def test_replace_all_refuses_modules_of_the_users_model():
    from tests.helpers.models import assert_unchanged, state_snapshot

    model = Stack()
    before = state_snapshot(model)
    sch = schedlang.create_schedule(model)
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"^<root>: replace_all got a Linear that is the module at 'layers.0.mlp.fc1' of the "
                             r"model given to create_schedule"):
        sch.replace_all(nn.Linear, lambda path, old: model.get_submodule(path))
    assert len(sch.plan) == 0
    sch.replace_all(nn.Linear, lambda path, old: old)
    sch["layers.0.mlp.fc1"].shard("weight", axis=0)
    assert_unchanged(model, before)

"""Replaying plans: safe reading (no imports the caller did not allow, malformed files explained),
the model fingerprint, and all-or-nothing application."""

import json
import sys

import pytest
import torch
from torch import nn

import schedlang
from schedlang.plan import Plan, apply_steps
from schedlang.module_record import shard_specs
from tests.helpers.models import MLP, Stack, assert_unchanged, state_snapshot

UNIMPORTED = "tests.helpers.plan_types"


def _plan_naming(type_name: str) -> str:
    """A plan whose trace step keeps ``type_name`` as a leaf (written as a saved plan would be)."""
    return json.dumps({"format": "schedlang-plan", "version": 1, "steps": [
        {"primitive": "trace", "path": "", "args": {"leaf_modules": [{"module_type": type_name}]}}]})


@pytest.fixture
def unimported():
    import tests.helpers as package

    saved = sys.modules.pop(UNIMPORTED, None), package.__dict__.pop("plan_types", None)
    yield
    sys.modules.pop(UNIMPORTED, None)
    package.__dict__.pop("plan_types", None)
    if saved[0] is not None:
        sys.modules[UNIMPORTED] = saved[0]
        package.plan_types = saved[1]


def test_a_plan_never_imports_a_module_it_names(unimported):
    with pytest.raises(schedlang.PlanSerializationError,
                       match=r"^step 0 \(trace at '<root>'\), argument 'leaf_modules': the plan names type "
                             r"'tests\.helpers\.plan_types\.SwishReplacement' from module 'tests\.helpers\.plan_types', "
                             r"which is not imported; a plan never imports modules by itself: import it before "
                             r"replaying, or pass trusted_modules=\['tests\.helpers\.plan_types'\] to schedlang\.replay$"):
        schedlang.replay(_plan_naming(f"{UNIMPORTED}.SwishReplacement"), Stack())
    assert UNIMPORTED not in sys.modules
    with pytest.raises(schedlang.PlanSerializationError, match=r"argument 'leaf_modules': 'os\.system' is not an "
                                                               r"nn\.Module subclass \(it is builtin_function_or_method\)$"):
        schedlang.replay(_plan_naming("os.system"), Stack())


def test_trusted_modules_are_imported_and_their_types_resolved(unimported):
    sch = schedlang.replay(_plan_naming(f"{UNIMPORTED}.SwishReplacement"), Stack(),
                           trusted_modules=["tests.helpers"], check_fingerprint=False)
    from tests.helpers.plan_types import SwishReplacement

    assert sch.plan[0].args["leaf_modules"] == [SwishReplacement]
    with pytest.raises(schedlang.ScheduleTypeError, match=r"trusted_modules lists module names .* got 3"):
        schedlang.replay(_plan_naming("torch.nn.GELU"), Stack(), trusted_modules=[3])
    with pytest.raises(schedlang.ScheduleTypeError, match=r"^replay: trusted_modules must be a list of module names "
                                                         r"such as \['my_package.layers'\] \(or modules\), got int$"):
        schedlang.replay(_plan_naming("torch.nn.GELU"), Stack(), trusted_modules=5)


def test_replace_all_type_and_function_are_checked_when_read():
    text = json.dumps({"format": "schedlang-plan", "version": 1, "steps": [
        {"primitive": "replace_all", "path": "", "args": {"module_type": "torch.nn.modules.activation:GELU",
                                                           "make_fn": "x"}}]})
    with pytest.raises(schedlang.PlanSerializationError,
                       match=r"^step 0 \(replace_all at '<root>'\), argument 'make_fn': must be a callable, got 'x'$"):
        Plan.from_json(text)
    bad = text.replace("torch.nn.modules.activation:GELU", "torch.nn.modules.activation:Nope")
    with pytest.raises(schedlang.PlanSerializationError, match=r"module 'torch\.nn\.modules\.activation' has no 'Nope'"):
        Plan.from_json(bad)


def _make_relu(path, old):
    return nn.ReLU()


STEP = {"primitive": "shard", "path": "fc1", "args": {"tensor_name": "weight", "axis": 0}}


def _doc(**changes):
    doc = {"format": "schedlang-plan", "version": 1, "steps": [dict(STEP)]}
    doc.update(changes)
    return json.dumps(doc)


@pytest.mark.parametrize("text,message", [
    (_doc(version=None), r"^plan: format version None is not supported; this schedlang reads version 1$"),
    ('{"format": "schedlang-plan", "steps": []}', r"^plan: the plan has no \"version\"; this schedlang reads version 1; "
                                                  r"add \"version\": 1 to the plan$"),
    ('{"format": "schedlang-plan", "version": 1}', r"^plan: the plan has no \"steps\": expected a list of step objects$"),
    (_doc(steps={"0": STEP}), r"^plan: the plan's \"steps\" must be a list of step objects, got dict$"),
    (_doc(steps=["shard"]), r"^plan: step 0 of the plan must be a JSON object with \"primitive\", \"path\" and \"args\", "
                            r"got 'shard'$"),
    (_doc(steps=[{"path": "fc1", "args": {}}]), r"^plan: step 0 of the plan is malformed: missing key \"primitive\"; "
                                                r"every step must name its primitive$"),
    (_doc(steps=[{"primitive": 3}]), r"^plan: step 0 of the plan is malformed or names an unknown primitive: primitives: unknown "
                                     r"primitive 3: registered primitives are annotate, "),
    (_doc(steps=[dict(STEP, path=["fc1"])]), r"^step 0 \(shard\): \"path\" must be a dotted module path \(a string\), "
                                             r"got \['fc1'\]$"),
    (_doc(steps=[dict(STEP, extra=1)]), r"^step 0 \(shard at 'fc1'\): unknown key\(s\) 'extra'; a step has "),
    (_doc(steps=[dict(STEP, args=[1])]), r"^step 0 \(shard at 'fc1'\): \"args\" must be a JSON object of argument "
                                         r"names to values, got \[1\]$"),
    (_doc(steps=[dict(STEP, args={"tensor_name": "weight"})]),
     r"^step 0 \(shard at 'fc1'\): missing argument 'axis' \(the dimension to split"),
    (_doc(steps=[dict(STEP, args={"tensor_name": "weight", "axis": "0"})]),
     r"^step 0 \(shard at 'fc1'\), argument 'axis': must be an int, got '0'$"),
    (_doc(steps=[dict(STEP, args={"tensor_name": "weight", "axis": 0, "dim": 1})]),
     r"^step 0 \(shard at 'fc1'\): shard has no argument\(s\) 'dim'; its arguments are tensor_name, axis$"),
    (_doc(steps=[{"primitive": "trace", "path": "", "args": {"concrete_args": {"x": {"tensor_example": {
        "shape": [2], "dtype": "load"}}}}}]),
     r"^step 0 \(trace at '<root>'\), argument 'concrete_args': concrete_args\['x'\] tensor_example must be "),
    (_doc(steps=[{"primitive": "fuse", "path": "", "args": {"subgraph": 5}}]),
     r"^step 0 \(fuse at '<root>'\), argument 'subgraph': expected subgraphs as \[\[\[path, node_name\], \.\.\.\], "),
    (_doc(model={"type": "MLP", "modules": "fc1"}), r"^plan: the plan's \"model\" record is malformed"),
])
def test_malformed_plans_say_where(text, message):
    with pytest.raises(schedlang.PlanSerializationError, match=message) as info:
        schedlang.replay(text, MLP())
    assert isinstance(info.value, schedlang.PlanError)


def test_plans_record_the_model_fingerprint_and_replay_checks_it():
    sch = schedlang.create_schedule(MLP())
    sch["fc1"].shard("weight", axis=0)
    data = sch.plan.to_dict()
    assert data["model"]["type"] == "MLP" and data["model"]["modules"][1] == "fc1 Linear weight[20,12] bias[20]"
    assert len(data["model"]["fingerprint"]) == 16
    text = sch.plan.to_json()
    schedlang.replay(text, MLP())  # same structure: fine
    with pytest.raises(schedlang.PlanMismatchError,
                       match=r"^plan: the plan was made for a different model \(MLP, fingerprint [0-9a-f]{16}; this MLP has "
                             r"[0-9a-f]{16}\): 'fc1\.weight' has shape \(24,12\) here and \(20,12\) in the plan's "
                             r"model\. Pass check_fingerprint=False to schedlang\.replay to apply it anyway$"):
        schedlang.replay(text, MLP(inner=24))
    with pytest.raises(schedlang.PlanMismatchError, match=r"'fc1' has no parameter 'bias' here"):
        schedlang.replay(text, MLP(bias=False))
    with pytest.raises(schedlang.PlanMismatchError, match=r"'<root>' is MLP in the plan's model and Stack here"):
        schedlang.replay(text, Stack())
    replayed = schedlang.replay(text, MLP(inner=24), check_fingerprint=False)
    assert replayed["fc1"].mod.weight.shape == (24, 12)


def test_plans_without_a_fingerprint_still_replay():
    sch = schedlang.create_schedule(MLP())
    sch["fc1"].shard("weight", axis=0)
    data = sch.plan.to_dict()
    del data["model"]
    replayed = schedlang.replay(json.dumps(data), MLP())
    assert replayed.plan.fingerprint is not None and len(replayed.plan) == 1


def test_replay_that_fails_at_step_k_applies_nothing():
    model = Stack()
    before = state_snapshot(model)
    sch = schedlang.create_schedule(Stack())
    sch["layers.0.mlp.fc1"].shard("weight", axis=0)
    sch["layers.0.mlp.fc1"].sync("bwd_post", "all_reduce")
    sch["layers.1.mlp.fc1"].decompose()
    sch["layers.1"].checkpoint()
    data = sch.plan.to_dict()
    data["steps"].append({"primitive": "shard", "path": "head", "args": {"tensor_name": "weight", "axis": 1}})
    data["steps"].append({"primitive": "shard", "path": "head", "args": {"tensor_name": "weight", "axis": 0}})
    with pytest.raises(schedlang.ShardError, match=r"^replaying step 5 \(shard at 'head'\): head: 'weight' is "
                                                   r"already sharded"):
        schedlang.replay(json.dumps(data), model)
    assert_unchanged(model, before)
    # on an existing schedule: the steps before the failure are undone too
    target = schedlang.create_schedule(Stack())
    target["head"].annotate("weight", "tag", 1)
    fc1 = target["layers.0.mlp.fc1"].mod
    weight = fc1.weight
    with pytest.raises(schedlang.ShardError, match=r"replaying step 5"):
        apply_steps(target, Plan.from_json(json.dumps(data)))
    assert len(target.plan) == 1 and target["layers.0.mlp.fc1"].mod is fc1 and fc1.weight is weight
    assert not fc1._forward_pre_hooks and not list(fc1.children())
    assert type(target["layers.1.mlp.fc1"].mod) is nn.Linear and "forward" not in target["layers.1"].mod.__dict__
    assert not shard_specs(target["layers.0.mlp.fc1"].mod)
    x = torch.randn(3, 12)
    ref = Stack()
    ref.load_state_dict(target.mod.state_dict())
    ref.eval(); target.mod.eval()
    torch.testing.assert_close(target.mod(x), ref(x))

import json

import pytest
import torch
from torch import nn

import schedlang
from schedlang.plan import Plan
from schedlang.module_record import module_record
from tests.helpers.models import MLP, Stack


def _schedule():
    sch = schedlang.create_schedule(Stack())
    sch["layers.0.mlp.fc1"].shard("weight", axis=0)
    sch["layers.0.mlp.fc1"].shard("bias", axis=0)
    sch["layers.0.mlp.fc2"].shard("weight", axis=1)
    sch["layers.0.mlp.fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["layers.0.mlp.fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["layers.1.mlp.fc1"].decompose()
    sch["layers.1"].checkpoint()
    sch["layers.1.drop"].fork_rng()
    sch.replace_all(nn.GELU, _make_relu)
    return sch


def _make_relu(path, old):
    return nn.ReLU()


def test_plan_prints_every_step_with_path_and_arguments():
    text = str(_schedule().plan)
    lines = text.splitlines()
    assert lines[0] == "Plan (9 steps)"
    assert "[0] shard" in lines[1] and "layers.0.mlp.fc1" in lines[1] and "tensor_name='weight', axis=0" in lines[1]
    assert "[3] sync" in lines[4] and "mode='fwd_post', sync_op_or_fn='all_reduce'" in lines[4]
    assert "[8] replace_all" in lines[9] and "module_type=GELU, make_fn=_make_relu" in lines[9]


def test_json_round_trip_and_replay_on_fresh_model():
    sch = schedlang.create_schedule(Stack())
    sch["layers.0.mlp.fc1"].shard("weight", axis=0)
    sch["layers.0.mlp.fc2"].sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-1)
    sch["layers.1.mlp.fc1"].decompose()
    sch["layers.1"].checkpoint()
    sch["head"].annotate("weight", "tag", "x")
    text = sch.plan.to_json()
    data = json.loads(text)
    assert data["format"] == "schedlang-plan" and len(data["steps"]) == 5
    assert Plan.from_json(text).to_json() == text
    fresh = Stack()
    replayed = schedlang.replay(text, fresh)
    assert str(replayed.plan) == str(sch.plan)
    assert type(replayed["layers.1.mlp.fc1"].mod).__name__ == "LinearWithSeparateBias"
    assert module_record(replayed["layers.1"].mod).checkpointed
    x = torch.randn(3, 12)
    fresh.eval(); replayed.mod.eval()
    torch.testing.assert_close(replayed.mod(x), fresh(x))


def test_callable_steps_cannot_be_serialized_but_replay_in_process():
    sch = _schedule()
    with pytest.raises(schedlang.PlanSerializationError,
                       match=r"step 8 \(replace_all at '<root>'\), argument 'make_fn' is a Python object \(function: "
                             r"<tests.test_plan._make_relu>\) and cannot be serialized to JSON"):
        sch.plan.to_json()
    replayed = schedlang.replay(sch.plan, Stack())
    assert isinstance(replayed["layers.0.mlp.act"].mod, nn.ReLU)
    assert len(replayed.plan) == len(sch.plan)


def test_callable_sync_not_serializable():
    sch = schedlang.create_schedule(MLP())
    sch["fc1"].sync("fwd_post", torch.relu)
    with pytest.raises(schedlang.PlanSerializationError, match=r"step 0 \(sync at 'fc1'\), argument 'sync_op_or_fn'"):
        sch.plan.to_json()


@pytest.mark.parametrize("text,message", [
    ("not json", r"not a schedlang plan: invalid JSON"),
    ('{"steps": []}', r"not a schedlang plan: expected a JSON object with \"format\": \"schedlang-plan\""),
    ('{"format": "schedlang-plan", "version": 99, "steps": []}', r"^plan: format version 99 is not supported"),
    ('{"format": "schedlang-plan", "version": 1, "steps": [{"primitive": "warp", "path": ""}]}',
     r"step 0 of the plan is malformed or names an unknown primitive: .*unknown primitive 'warp'"),
])
def test_bad_plan_json(text, message):
    with pytest.raises(schedlang.PlanError, match=message):
        schedlang.replay(text, MLP())


def test_replay_on_a_different_model_names_the_step():
    sch = schedlang.create_schedule(Stack())
    sch["layers.0.mlp.fc1"].shard("weight", axis=0)
    # the fingerprint check (tests/test_replaying.py) would refuse the model first
    with pytest.raises(schedlang.ScheduleKeyError, match=r"replaying step 0 \(shard at 'layers.0.mlp.fc1'\): "
                       r"<root>: no submodule 'layers'"):
        schedlang.replay(sch.plan.to_json(), MLP(), check_fingerprint=False)


def test_plan_slicing_and_iteration():
    plan = _schedule().plan
    assert len(plan[2:4]) == 2 and [s.primitive for s in plan][:2] == ["shard", "shard"]

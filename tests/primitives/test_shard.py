import pytest
import torch
from torch import nn

import schedlang
from schedlang.distributed.sharding import shard_source
from schedlang.module_record import module_record, shard_specs
from tests.helpers.models import MLP


def test_shard_records_spec_and_keeps_module_consistent_single_rank():
    sch = schedlang.create_schedule(MLP(12, 20))
    sch["fc1"].shard("weight", axis=0)
    sch["fc1"].shard("bias", axis=-1)
    spec = shard_specs(sch["fc1"].mod)["bias"]
    assert spec.axis == 0 and spec.world_size == 1 and spec.full_shape == (20,)
    assert sch["fc1"].mod.out_features == 20
    assert str(sch.plan).count("shard") == 2
    assert sch.plan[1].args == {"tensor_name": "bias", "axis": 0}  # negative axis normalized


def test_sharded_parameter_is_a_new_tensor_linked_to_its_source():
    sch = schedlang.create_schedule(MLP())
    old = sch["fc2"].mod.weight
    sch["fc2"].shard("weight", axis=1)
    new = sch["fc2"].mod.weight
    assert new is not old and isinstance(new, nn.Parameter)
    src, spec = shard_source(new)
    assert src is old and spec.axis == 1
    torch.testing.assert_close(new, spec.slice_of(old))


def test_shard_buffer():
    model = nn.BatchNorm1d(6)
    sch = schedlang.create_schedule(model)
    sch.shard("running_mean", axis=0)
    assert "running_mean" in shard_specs(sch.mod)


@pytest.mark.parametrize("name,axis,error,message", [
    ("weights", 0, schedlang.ScheduleKeyError,
     r"fc1: Linear has no parameter or buffer 'weights'; valid names: weight, bias"),
    ("weight", 5, schedlang.ShardError,
     r"fc1: cannot shard 'weight' \(shape \(20, 12\)\) along axis 5: valid axes are 0, 1"),
    ("weight", -3, schedlang.ShardError, r"along axis -3: valid axes are 0, 1"),
    ("weight", 1.0, schedlang.ScheduleTypeError, r"fc1: shard axis must be an int, got 1.0"),
    (3, 0, schedlang.ScheduleTypeError, r"fc1: shard expects a tensor name \(str\), got 3"),
])
def test_bad_shard_arguments(name, axis, error, message):
    sch = schedlang.create_schedule(MLP(12, 20))
    with pytest.raises(error, match=message):
        sch["fc1"].shard(name, axis)
    assert len(sch.plan) == 0


def test_shard_twice_and_row_parallel_bias_rejected():
    sch = schedlang.create_schedule(MLP())
    sch["fc1"].shard("weight", axis=0)
    with pytest.raises(schedlang.ShardError, match=r"fc1: 'weight' is already sharded \(along axis 0\)"):
        sch["fc1"].shard("weight", axis=1)
    sch["fc2"].shard("weight", axis=1)
    with pytest.raises(schedlang.ShardError, match=r"fc2: cannot shard 'bias' of a row-parallel Linear"):
        sch["fc2"].shard("bias", axis=0)


def test_module_without_tensors():
    sch = schedlang.create_schedule(MLP())
    with pytest.raises(schedlang.ScheduleKeyError, match=r"act: GELU has no parameter or buffer 'weight'; valid "
                       r"names: none \(it owns no tensors\)"):
        sch["act"].shard("weight", 0)


def test_row_parallel_linear_with_bias_adds_bias_once_single_rank():
    model = MLP()
    sch = schedlang.create_schedule(model)
    sch["fc2"].sync("fwd_post", "all_reduce")  # registered before the shard: must move before the bias
    sch["fc2"].shard("weight", axis=1)
    x = torch.randn(4, 12)
    torch.testing.assert_close(sch.mod(x), model(x))
    record = module_record(sch["fc2"].mod)
    assert record.syncs_before_bias and [s.child for s in record.syncs] == ["_schedlang_sync_fwd_post_0"]
    assert not sch["fc2"].mod._forward_hooks


def test_module_walk_matches_named_modules_with_shared_modules():
    shared = nn.Linear(3, 3)
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), MLP(), shared, nn.ModuleDict({"a": shared, "b": None}))
    sch = schedlang.create_schedule(model)
    assert [(p, type(m)) for p, m in sch["1"]._walk()] == \
        [(p, type(m)) for p, m in sch.mod.named_modules(remove_duplicate=False)]
    assert sch._state.walk_of_running is None  # outside a primitive nothing is kept


def test_a_primitive_walks_the_model_once_and_forgets_the_walk():
    sch = schedlang.create_schedule(MLP())
    walks = []
    original = type(sch)._walk

    def counted(self):
        walk = original(self)
        walks.append(id(walk))
        return walk

    type(sch)._walk = counted
    try:
        sch["fc1"].shard("weight", axis=0)  # its checks and its apply look for the weight's holders
    finally:
        type(sch)._walk = original
    assert len(walks) >= 2 and len(set(walks)) == 1
    assert sch._state.walk_of_running is None and sch._state.primitives_running == 0


def test_tied_tensor_holders_are_found_under_every_path():
    from schedlang.primitives.shard import _holders

    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    sch = schedlang.create_schedule(model)
    found = [(p, n) for p, _, n in _holders(sch["1"], sch["1"].mod.weight)]
    assert found == [("1", "weight"), ("0", "weight")]  # this module first, then the model's order

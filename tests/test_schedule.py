import pytest
import torch
from torch import nn

import schedlang
from schedlang.schedule import Schedule
from tests.helpers.models import MLP, Stack, assert_unchanged, state_snapshot


def test_tree_mirrors_module_hierarchy():
    sch = schedlang.create_schedule(Stack())
    assert sch.path == "" and sch.name == "" and sch.parent is None
    mlp = sch["layers.1.mlp"]
    assert mlp.path == "layers.1.mlp" and mlp.name == "mlp"
    assert isinstance(mlp.mod, MLP)
    assert mlp.parent.path == "layers.1" and mlp.parent.parent.path == "layers"
    assert sch["layers"]["1"]["mlp"].mod is mlp.mod
    assert list(sch.child) == ["layers", "head"]
    assert list(sch["layers.0"].child) == ["norm", "mlp", "drop"]
    paths = [p for p, _ in sch.named_schedules()]
    assert paths[:3] == ["", "layers", "layers.0"] and "layers.1.mlp.fc2" in paths
    assert "layers.0.mlp" in sch and "layers.9" not in sch


def test_schedule_works_on_a_copy_and_never_mutates_the_model():
    model = Stack()
    before = state_snapshot(model)
    sch = schedlang.create_schedule(model)
    assert sch.mod is not model
    sch["layers.0.mlp.fc1"].shard("weight", axis=0)
    sch["layers.0.mlp.fc1"].sync("bwd_post", "all_reduce")
    sch["layers.0.mlp.fc2"].decompose()
    sch["layers.1"].checkpoint()
    sch["layers.1.mlp"].fork_rng()
    sch["head"].annotate("weight", "note", 3)
    sch["layers.0.drop"].replace(nn.Identity())
    sch.replace_all(nn.GELU, lambda path, old: nn.ReLU())
    assert_unchanged(model, before)


def test_unknown_path_names_it_and_lists_children():
    sch = schedlang.create_schedule(Stack())
    with pytest.raises(schedlang.ScheduleKeyError, match=r"layers: no submodule '7' \(looking up 'layers.7.mlp'\); "
                       r"valid children: 0, 1"):
        sch["layers.7.mlp"]
    with pytest.raises(KeyError, match=r"layers.0.mlp.fc1: no submodule 'x' .* valid children: none \(a leaf module\)"):
        sch["layers.0.mlp"]["fc1"]["x"]
    with pytest.raises(schedlang.ScheduleTypeError, match="schedule paths are strings"):
        sch[0]


def test_create_schedule_rejects_non_modules():
    with pytest.raises(schedlang.ScheduleTypeError, match="expects a torch.nn.Module, got list"):
        schedlang.create_schedule([1, 2])


def test_single_process_group_properties():
    sch = schedlang.create_schedule(MLP())
    assert sch.world_size == 1 and sch.rank == 0 and sch.group is None
    sch["fc1"].metadata["x"] = 1
    assert sch["fc1"].metadata == {"x": 1}


def test_schedule_methods_match_registered_primitives():
    methods = {n for n, v in vars(Schedule).items() if callable(v) and not n.startswith("_")
               and n not in ("named_schedules", "atomic", "report")}
    assert methods == set(schedlang.list_primitives())


def test_failed_primitive_leaves_the_tree_unchanged(monkeypatch):
    sch = schedlang.create_schedule(MLP())
    from schedlang.primitives import shard as shard_module

    def explode(*a, **k):
        raise RuntimeError("rule failed")

    weight = sch["fc1"].mod.weight
    monkeypatch.setattr(shard_module, "find_shard_rule", lambda m: type("R", (), {"check": lambda *a: None,
                                                                                  "after_shard": explode}))
    with pytest.raises(RuntimeError, match="rule failed"):
        sch["fc1"].shard("weight", axis=0)
    assert sch["fc1"].mod.weight is weight
    assert not hasattr(sch["fc1"].mod, "_schedlang_shards")
    assert len(sch.plan) == 0


def test_atomic_block_undoes_every_step_on_failure():
    model = Stack()
    sch = schedlang.create_schedule(model)
    sch["head"].decompose()
    with pytest.raises(schedlang.ShardError, match="valid axes are 0, 1"):
        with sch.atomic():
            sch["layers.0.mlp.fc1"].shard("weight", axis=0)
            sch["layers.0.mlp.fc1"].sync("bwd_post", "all_reduce")
            sch["layers.1"].checkpoint()
            sch["layers.1.mlp.fc1"].shard("weight", axis=4)
    assert len(sch.plan) == 1 and sch.plan[0].primitive == "decompose"
    fc1 = sch["layers.0.mlp.fc1"].mod
    assert fc1.weight.shape == (20, 12) and not hasattr(fc1, "_schedlang_shards")
    assert not fc1._forward_pre_hooks and not list(fc1.children())
    assert "forward" not in sch["layers.1"].mod.__dict__
    assert "shards" not in sch["layers.0.mlp.fc1"].metadata
    with sch.atomic():
        sch["layers.0.mlp.fc1"].shard("weight", axis=0)
    assert len(sch.plan) == 2

import inspect

import pytest
import torch
from torch import nn

import schedlang
from schedlang.primitives.base import get_primitive, signature_mismatch
from schedlang.schedule import Schedule
from schedlang.module_record import ModuleRecord, module_record, shard_specs
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
    with pytest.raises(schedlang.ScheduleTypeError, match="the model must be a torch.nn.Module, got list"):
        schedlang.create_schedule([1, 2])


def test_single_process_group_properties():
    sch = schedlang.create_schedule(MLP())
    assert sch.world_size == 1 and sch.rank == 0 and sch.group is None
    sch["fc1"].metadata["x"] = 1
    assert sch["fc1"].metadata == {"x": 1}


def test_schedule_methods_match_registered_primitives():
    methods = {n for n, v in vars(Schedule).items() if callable(v) and not n.startswith("_")
               and n not in ("named_schedules", "atomic", "report",
                             # Slapo's plain query and helper methods (not primitives, no step of their own)
                             "get_top_schedule", "tokenize_module_path", "get_module", "find_node", "find_subgraph",
                             "trace_until", "update_submodule")}
    assert methods == set(schedlang.list_primitives())


@pytest.mark.parametrize("name", schedlang.list_primitives())
def test_each_method_signature_and_docstring_come_from_the_declaration(name):
    primitive = get_primitive(name)
    method = getattr(Schedule, name)
    assert signature_mismatch(method, primitive) == ""
    actual = inspect.signature(method).parameters
    declared = [p for p in primitive.params if not p.option and p.variadic != "**"]
    assert [n for n, p in actual.items() if p.kind is not p.VAR_KEYWORD][1:] == [p.name for p in declared]
    for p in declared:
        if p.variadic:
            assert actual[p.name].kind is inspect.Parameter.VAR_POSITIONAL, p.name
        else:
            assert actual[p.name].default == (inspect.Parameter.empty if p.required else p.default), p.name
    assert any(p.kind is p.VAR_KEYWORD for p in actual.values()) == bool(
        primitive.options() or any(p.variadic == "**" for p in primitive.params))
    doc = method.__doc__
    assert doc == primitive.method_doc() and doc.startswith(inspect.cleandoc(primitive.__doc__))
    for p in primitive.params:
        assert p.doc and f"{p.name} (" in doc or f"``{p.name}``" in doc, p.name


def test_a_method_that_drifts_from_its_declaration_is_refused_when_defined():
    from schedlang.schedule import _primitive_method

    def shard(self, tensor_name: str, axis: int = 0): ...

    with pytest.raises(TypeError, match=r"Schedule\.shard does not match its primitive's declaration: 'axis' "
                                        r"defaults to 0, declared <class 'inspect\._empty'>"):
        _primitive_method(shard)

    def sync(self, mode: str, sync_op_or_fn: str = "all_reduce"): ...

    with pytest.raises(TypeError, match=r"arguments \(mode: str, sync_op_or_fn: str = 'all_reduce'\) instead of "):
        _primitive_method(sync)


def test_arguments_are_type_checked_from_the_declaration():
    sch = schedlang.create_schedule(MLP())
    with pytest.raises(schedlang.ArgumentTypeError, match=r"^fc1: annotate param_name must be a str, got 3$") as info:
        sch["fc1"].annotate(3, "k", 1)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    with pytest.raises(schedlang.ArgumentTypeError, match=r"^<root>: fully_shard offload must be True or False, "
                                                          r"got 'yes'$"):
        sch.fully_shard(offload="yes")
    with pytest.raises(schedlang.ArgumentTypeError, match=r"^<root>: fully_shard reshard_after_forward must be None, "
                                                          r"a bool or an int \(ranks to reshard to\), got 1\.5$"):
        sch.fully_shard(reshard_after_forward=1.5)
    with pytest.raises(schedlang.ArgumentTypeError, match=r"^fc1: shard takes no argument\(s\) dim; its arguments are "
                                                          r"tensor_name, axis$"):
        sch["fc1"]._run("shard", tensor_name="weight", dim=0)
    with pytest.raises(schedlang.ArgumentTypeError, match=r"^fc1: shard needs the argument 'axis' \(the dimension "):
        sch["fc1"]._run("shard", tensor_name="weight")
    assert len(sch.plan) == 0


def test_failed_step_inside_atomic_undoes_a_fused_graph():
    sch = schedlang.create_schedule(MLP(7, 13))
    sch.trace(flatten=True)
    x = torch.randn(5, 7)
    expected = sch.mod(x)
    code = sch.mod.code
    with pytest.raises(schedlang.ShardError):
        with sch.atomic():
            sch.fuse(sch.find(lambda a: torch.nn.functional.gelu(a)), compiler="eager", name="Act")
            assert "Act" in sch.mod.code
            sch["fc1"].shard("weight", axis=9)
    assert sch.mod.code == code and not hasattr(sch.mod, "Act_0")
    torch.testing.assert_close(sch.mod(x), expected)


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
    assert not shard_specs(sch["fc1"].mod)
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
    assert fc1.weight.shape == (20, 12) and module_record(fc1) == ModuleRecord()
    assert not fc1._forward_pre_hooks and not list(fc1.children())
    assert "forward" not in sch["layers.1"].mod.__dict__
    assert not module_record(sch["layers.1"].mod).checkpointed
    with sch.atomic():
        sch["layers.0.mlp.fc1"].shard("weight", axis=0)
    assert len(sch.plan) == 2


def _count_snapshots(monkeypatch):
    import schedlang.schedule as schedule_module

    taken = []
    original = schedule_module._Undo.__init__

    def counting(self, state):
        taken.append(1)
        original(self, state)

    monkeypatch.setattr(schedule_module._Undo, "__init__", counting)
    return taken


def test_a_block_without_nested_undo_takes_one_snapshot_and_still_undoes_every_step(monkeypatch):
    sch = schedlang.create_schedule(Stack())
    sch["head"].decompose()
    taken = _count_snapshots(monkeypatch)
    with pytest.raises(schedlang.ShardError, match="valid axes are 0, 1"):
        with sch.atomic(nested_undo=False):
            sch["layers.0.mlp.fc1"].shard("weight", axis=0)
            sch["layers.0.mlp.fc1"].sync("bwd_post", "all_reduce")
            with sch.atomic():  # covered by the block's undo as well
                sch["layers.1"].checkpoint()
            sch["layers.1.mlp.fc1"].shard("weight", axis=4)
    assert len(taken) == 1
    assert len(sch.plan) == 1 and sch.plan[0].primitive == "decompose"
    fc1 = sch["layers.0.mlp.fc1"].mod
    assert fc1.weight.shape == (20, 12) and module_record(fc1) == ModuleRecord()
    assert not fc1._forward_pre_hooks and not module_record(sch["layers.1"].mod).checkpointed
    # after the block, every primitive is all-or-nothing on its own again
    taken.clear()
    sch["layers.0.mlp.fc1"].shard("weight", axis=0)
    with sch.atomic(nested_undo=False):
        sch["layers.0.mlp.fc2"].shard("weight", axis=1)
    sch["layers.1.mlp.fc1"].shard("weight", axis=0)
    assert len(taken) == 3 and len(sch.plan) == 4


def test_a_primitive_error_caught_in_an_ordinary_block_leaves_nothing_of_that_primitive():
    sch = schedlang.create_schedule(Stack())
    with sch.atomic():
        with pytest.raises(schedlang.ShardError):
            sch["layers.0.mlp.fc1"].shard("weight", axis=4)
        sch["layers.0.mlp.fc1"].shard("weight", axis=0)
    assert [s.primitive for s in sch.plan] == ["shard"]
    assert shard_specs(sch["layers.0.mlp.fc1"].mod)["weight"].axis == 0


@pytest.mark.parametrize("call, message", [
    (lambda s: s["layers.0.mlp.fc1"].shard("weight"),
     r"^layers.0.mlp.fc1: shard got the wrong arguments \(missing a required argument: 'axis'\); call it as "
     r"shard\(tensor_name, axis\)$"),
    (lambda s: s["layers.0.mlp.fc1"].shard("weight", 0, dim=1),
     r"^layers.0.mlp.fc1: shard got the wrong arguments \(got an unexpected keyword argument 'dim'\); call it as "
     r"shard\(tensor_name, axis\)$"),
    (lambda s: s["layers.0.mlp.fc1"].decompose(True),
     r"^layers.0.mlp.fc1: decompose got the wrong arguments \(too many positional arguments\); call it as "
     r"decompose\(\)$"),
    (lambda s: s["layers.1"].fork_rng(0),
     r"^layers.1: fork_rng got the wrong arguments \(too many positional arguments\); call it as fork_rng\(\)$"),
    (lambda s: s["layers.0"].sync(),
     r"^layers.0: sync got the wrong arguments \(missing a required argument: 'mode'\); call it as "
     r"sync\(mode, sync_op_or_fn='all_reduce', \*\*options\)$"),
], ids=["missing", "unknown keyword", "too many", "too many, no arguments declared", "missing, with options"])
def test_a_primitive_called_with_the_wrong_arguments_names_the_path_and_the_call(call, message):
    # Python's bare TypeError from binding the arguments named neither the schedule path nor the valid call
    model = Stack()
    before = state_snapshot(model)
    sch = schedlang.create_schedule(model)
    with pytest.raises(schedlang.SchedlangError, match=message) as caught:
        call(sch)
    assert isinstance(caught.value, TypeError)  # still what a Python programmer expects
    assert len(sch.plan) == 0
    assert_unchanged(model, before)
    sch["layers.0.mlp.fc1"].shard("weight", 0)  # the schedule goes on as if nothing happened
    assert len(sch.plan) == 1


def test_report_refuses_a_path_that_is_not_a_path(tmp_path):
    sch = schedlang.create_schedule(MLP())
    with pytest.raises(schedlang.ScheduleTypeError, match=r"^<root>: report expects the path of the HTML file to "
                                                          r"write \(a str or os.PathLike such as 'report.html'\), "
                                                          r"got int 3$"):
        sch.report(3)
    assert not any(tmp_path.iterdir())

"""One record per module: what shard, sync, decompose, checkpoint and fuse did to a module lives in its
``ModuleRecord`` and nowhere else, survives copies and replacement, and goes away with a failed step."""

import contextlib
import copy
import re
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

import schedlang
import schedlang.distributed.groups as groups
from schedlang.distributed.sharding import ShardSpec, shard_specs as public_shard_specs, unsharded_view
from schedlang.module_record import (RECORD_ATTR, ModuleRecord, SyncSpec, change_class, module_record,
                                     original_view, shard_specs)
from schedlang.primitives.decompose import LinearWithSeparateBias
from tests.helpers.models import MLP, Stack

PACKAGE = Path(__file__).resolve().parent.parent / "schedlang"


@contextlib.contextmanager
def fake_group(world, rank):
    with mock.patch.object(groups, "world_size", lambda group=None: world), \
            mock.patch.object(groups, "rank", lambda group=None: rank):
        yield


def _schedlang_attributes(module: nn.Module):
    return sorted(k for k in vars(module) if k.startswith("_schedlang_"))


def _scheduled_fc2(model):
    sch = schedlang.create_schedule(model)
    sch["fc2"].decompose()
    sch["fc2"].shard("weight", axis=1)
    sch["fc2"].sync("fwd_post", "all_reduce")
    sch["fc2"].checkpoint(preserve_rng_state=False)
    sch["fc2"].annotate("weight", "orig_shape", [7, 13])
    return sch


def test_a_sharded_synced_decomposed_checkpointed_module_has_one_record():
    model = MLP(hidden=7, inner=13)
    sch = _scheduled_fc2(model)
    fc2 = sch["fc2"].mod
    assert type(fc2) is LinearWithSeparateBias and fc2.weight is not model.fc2.weight
    assert _schedlang_attributes(fc2) == [RECORD_ATTR]
    record = module_record(fc2)
    assert record == ModuleRecord(
        shards={"weight": ShardSpec(axis=1, world_size=1, rank=0, full_shape=(7, 13))},
        syncs=(SyncSpec(mode="fwd_post", op="all_reduce", child="_schedlang_sync_fwd_post_0"),),
        syncs_before_bias=True, checkpointed=True,
        checkpoint_options={"preserve_rng_state": False}, annotations={"weight": {"orig_shape": [7, 13]}})
    assert fc2.weight.orig_shape == [7, 13]
    assert shard_specs(fc2) == public_shard_specs(fc2) == dict(record.shards)
    # the row-parallel linear runs its sync itself, before its bias: no hook does it a second time
    assert not fc2._forward_hooks
    # the unscheduled modules carry nothing
    assert all(not _schedlang_attributes(m) for m in (sch["fc1"].mod, sch["act"].mod, sch.mod))
    x = torch.randn(5, 7, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, ref = sch.mod(x), model(x_ref)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(fc2.weight.grad, model.fc2.weight.grad)
    torch.testing.assert_close(fc2.bias.grad, model.fc2.bias.grad)


def test_the_report_reads_the_record():
    from schedlang.report.collect import _module_notes

    sch = _scheduled_fc2(MLP(hidden=7, inner=13))
    notes = _module_notes(sch["fc2"].mod, sch["fc2"].metadata)
    assert notes == ["weight split on axis 1", "sync _schedlang_sync_fwd_post_0: fwd_post all_reduce",
                     "activations recomputed in backward"]
    assert "shards" not in sch["fc2"].metadata and "syncs" not in sch["fc2"].metadata


def test_the_record_survives_deepcopy_and_replay():
    sch = _scheduled_fc2(MLP(hidden=7, inner=13))
    record = module_record(sch["fc2"].mod)
    copied = copy.deepcopy(sch.mod)
    assert module_record(copied.fc2) == record and module_record(copied.fc2) is not record
    replayed = schedlang.replay(sch.plan.to_json(), MLP(hidden=7, inner=13))
    assert module_record(replayed["fc2"].mod) == record


def test_decompose_puts_a_new_module_in_place_holding_the_same_parameters_hooks_and_record():
    model = MLP(hidden=7, inner=13)
    sch = schedlang.create_schedule(model)
    sch["fc2"].sync("fwd_pre", "all_reduce")
    sch["fc2"].checkpoint()
    old = sch["fc2"].mod
    weight, bias, hooks = old.weight, old.bias, dict(old._forward_pre_hooks)
    sch["fc2"].decompose()
    new = sch["fc2"].mod
    assert new is not old and type(old) is nn.Linear and type(new) is LinearWithSeparateBias
    assert new.weight is weight and new.bias is bias and dict(new._forward_pre_hooks) == hooks
    assert module_record(new) == module_record(old) and module_record(new).checkpointed
    assert new.forward.__self__ is new  # the checkpointing forward wraps the new module
    x = torch.randn(3, 7)
    torch.testing.assert_close(sch.mod(x), model(x))


def test_a_failed_step_leaves_no_trace_in_the_record():
    sch = schedlang.create_schedule(Stack())
    sch["layers.0.mlp.fc1"].shard("weight", axis=0)
    fc1 = sch["layers.0.mlp.fc1"].mod
    before = module_record(fc1)
    with pytest.raises(schedlang.ShardError, match="valid axes are 0, 1"):
        with sch.atomic():
            sch["layers.0.mlp.fc1"].shard("bias", axis=0)
            sch["layers.0.mlp.fc1"].sync("bwd_post", "all_reduce")
            sch["layers.0.mlp.fc2"].decompose()
            sch["layers.0.mlp.fc2"].shard("weight", axis=1)
            sch["layers.1"].checkpoint()
            sch["layers.1.mlp.fc1"].shard("weight", axis=4)
    assert sch["layers.0.mlp.fc1"].mod is fc1 and module_record(fc1) is before
    assert list(module_record(fc1).shards) == ["weight"] and not module_record(fc1).syncs
    fc2 = sch["layers.0.mlp.fc2"].mod
    assert type(fc2) is nn.Linear and module_record(fc2) == ModuleRecord() and not _schedlang_attributes(fc2)
    assert module_record(sch["layers.1"].mod) == ModuleRecord()


def test_a_shard_rule_class_change_records_the_original_class_and_build_initializes_at_full_size():
    torch.manual_seed(0)
    full = nn.Embedding(16, 6)
    with schedlang.init_empty_weights():
        meta = nn.Embedding(16, 6)
    with fake_group(2, 1):
        sch = schedlang.create_schedule(meta)
        sch.shard("weight", axis=0)
        assert type(sch.mod).__name__ == "VocabParallelEmbedding"
        assert original_view(sch.mod) == unsharded_view(sch.mod) == (nn.Embedding, {"num_embeddings": 16,
                                                                                       "padding_idx": None})
        torch.manual_seed(0)
        built = schedlang.build(sch, device="cpu")[0]
    torch.testing.assert_close(built.weight, full.weight[8:])


def test_change_class_keeps_the_first_original_class():
    module = nn.Linear(3, 4)
    change_class(module, LinearWithSeparateBias)
    change_class(module, type("Again", (LinearWithSeparateBias,), {}))
    assert module_record(module).original_class is nn.Linear


def test_the_element_record_accepts_an_init_that_writes_a_child_tensor_in_parts():
    class WritesChildInHalves(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = nn.Linear(4, 6)

        def reset_parameters(self):
            with torch.no_grad():
                self.child.weight[:3].fill_(1.0)
                self.child.weight[3:].fill_(2.0)

    with schedlang.init_empty_weights():
        meta = WritesChildInHalves()
    with fake_group(2, 1):
        sch = schedlang.create_schedule(meta)
        sch["child"].shard("weight", axis=0)
        built = schedlang.build(sch, device="cpu")[0]
    torch.testing.assert_close(built.child.weight, torch.full((3, 4), 2.0))


_OLD_NAMES = [
    r"_schedlang_shards\b", r"_schedlang_unsharded\b", r"_schedlang_inner_post_syncs\b",
    r"_schedlang_checkpointed\b", r"_schedlang_checkpoint_options\b", r"_schedlang_fused\b",
    r"_schedlang_annotations\b",
    r"metadata\[[\"']shards[\"']\]", r"metadata\[[\"']syncs[\"']\]", r"setdefault\([\"'](shards|syncs)[\"']",
    r"fill_\(float\([\"']nan[\"']\)\)",
]


@pytest.mark.parametrize("pattern", _OLD_NAMES)
def test_no_parallel_bookkeeping_is_left_in_the_package(pattern):
    found = [f"{p.relative_to(PACKAGE.parent)}:{i}" for p in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(pattern, line)]
    assert not found, f"{pattern} is still used at {', '.join(found)}"


def test_classes_change_in_one_place():
    allowed = {"schedlang/module_record.py", "schedlang/schedule.py"}  # the helper, and undo restoring a class
    found = [str(p.relative_to(PACKAGE.parent)) for p in sorted(PACKAGE.rglob("*.py"))
             if re.search(r"\.__class__\s*=[^=]", p.read_text())]
    assert set(found) <= allowed, found

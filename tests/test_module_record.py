"""One record per module: what shard, sync, decompose, checkpoint and fuse did to a module lives in its
``ModuleRecord`` and nowhere else, survives copies and replacement, and goes away with a failed step.
A module that needs another class is replaced by a new instance, never changed in place."""

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
from schedlang.distributed.shard_rules import ShardRule, register_shard_rule
from schedlang.distributed.shard_rules.embedding import VocabParallelEmbedding
from schedlang.module_record import (RECORD_ATTR, ModuleRecord, SyncSpec, copy_module_as, module_record,
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


def test_a_shard_rule_replacement_records_the_original_class_and_build_initializes_at_full_size():
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


def test_a_replacement_keeps_the_first_original_class():
    module = nn.Linear(3, 4)
    once = copy_module_as(module, LinearWithSeparateBias, remember_class=True)
    twice = copy_module_as(once, type("Again", (LinearWithSeparateBias,), {}), remember_class=True)
    assert module_record(once).original_class is module_record(twice).original_class is nn.Linear
    assert type(module) is nn.Linear and module_record(module) == ModuleRecord()
    assert twice.weight is module.weight and twice.bias is module.bias


# --------------------------------------------------------------------------- shard rules install replacements

def _row_parallel_fc2(world, rank, model=None):
    model = model if model is not None else MLP(hidden=7, inner=12)
    with fake_group(world, rank):
        sch = schedlang.create_schedule(model)
        old = sch["fc2"].mod
        sch["fc2"].shard("weight", axis=1)
    return model, sch, old


@pytest.mark.parametrize("rank", [0, 1])
def test_a_row_parallel_linear_is_a_new_module_in_place_holding_the_same_parameters(rank):
    model, sch, old = _row_parallel_fc2(2, rank)
    new = sch["fc2"].mod
    assert type(new) is LinearWithSeparateBias and new is not old
    assert sch.mod.fc2 is new and sch.root["fc2"].mod is new and dict(sch.mod.named_children())["fc2"] is new
    assert type(old) is nn.Linear  # the module it stands in for keeps its class
    assert new.weight is old.weight and new.bias is old.bias and new._parameters is not old._parameters
    assert new.weight is not model.fc2.weight and new.bias is not model.fc2.bias
    record = module_record(new)
    assert record.original_class is nn.Linear and record.syncs_before_bias
    assert record.shards == {"weight": ShardSpec(axis=1, world_size=2, rank=rank, full_shape=(7, 12))}
    assert (new.in_features, new.out_features) == (6, 7) and (old.in_features, old.out_features) == (12, 7)
    assert original_view(new)[0] is nn.Linear
    # rank r's partial product over its inputs, plus the whole bias once (the all-reduce would add the parts)
    h = torch.randn(5, 12, requires_grad=True)
    h_ref = h.detach().clone().requires_grad_()
    part = slice(rank * 6, (rank + 1) * 6)
    cot = torch.randn(5, 7)
    out = new(h[:, part])
    ref = h_ref[:, part] @ model.fc2.weight[:, part].T + model.fc2.bias
    torch.testing.assert_close(out, ref)
    (out * cot).sum().backward()
    (ref * cot).sum().backward()
    torch.testing.assert_close(new.weight.grad, model.fc2.weight.grad[:, part])
    torch.testing.assert_close(new.bias.grad, model.fc2.bias.grad)
    torch.testing.assert_close(h.grad[:, part], h_ref.grad[:, part])


def test_a_row_parallel_shard_in_a_failed_atomic_block_puts_the_original_module_back():
    model = MLP(hidden=7, inner=12)
    with fake_group(2, 1):
        sch = schedlang.create_schedule(model)
        old = sch["fc2"].mod
        weight, bias = old.weight, old.bias
        with pytest.raises(schedlang.ShardError, match="valid axes are 0, 1"):
            with sch.atomic():
                sch["fc2"].shard("weight", axis=1)
                assert type(sch["fc2"].mod) is LinearWithSeparateBias
                sch["fc1"].shard("weight", axis=5)
    assert sch["fc2"].mod is old and sch.mod.fc2 is old and type(old) is nn.Linear
    assert old.weight is weight and old.bias is bias and tuple(old.weight.shape) == (7, 12)
    assert (old.in_features, old.out_features) == (12, 7)
    assert module_record(old) == ModuleRecord() and not _schedlang_attributes(old)
    assert len(sch.plan) == 0
    x = torch.randn(3, 7)
    torch.testing.assert_close(sch.mod(x), model(x))


def test_a_rule_that_fails_after_the_replacement_leaves_the_original_module(monkeypatch):
    from schedlang.distributed.shard_rules.linear import LinearShardRule

    def explode(*args):
        raise RuntimeError("after_shard failed")

    monkeypatch.setattr(LinearShardRule, "after_shard", classmethod(explode))
    with fake_group(2, 0):
        sch = schedlang.create_schedule(MLP(hidden=7, inner=12))
        old = sch["fc2"].mod
        with pytest.raises(RuntimeError, match="after_shard failed"):
            sch["fc2"].shard("weight", axis=1)
    assert sch["fc2"].mod is old and type(old) is nn.Linear and tuple(old.weight.shape) == (7, 12)
    assert module_record(old) == ModuleRecord() and len(sch.plan) == 0


class _SharedTwice(nn.Module):
    """The same Linear at two paths."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 5)
        self.second = self.first

    def forward(self, x):
        return self.first(x) + self.second(x)


def test_a_module_held_at_two_paths_is_replaced_at_both():
    with fake_group(2, 0):
        sch = schedlang.create_schedule(_SharedTwice())
        old = sch["first"].mod
        sch["first"].shard("weight", axis=1)
    new = sch["first"].mod
    assert type(new) is LinearWithSeparateBias and sch.mod.second is new  # (the schedule lists a shared child once)
    assert type(old) is nn.Linear


class _TiedLM(nn.Module):
    """Word embeddings tied to an LM head and to a second embedding (an encoder-decoder's shared table)."""

    def __init__(self, vocab=12, dim=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.decoder_embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.decoder_embed.weight = self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids) + self.decoder_embed(ids))


@pytest.mark.parametrize("rank", [0, 1])
def test_tied_holders_are_each_replaced_if_their_rule_asks_and_stay_tied(rank):
    model = _TiedLM()
    with fake_group(2, rank):
        sch = schedlang.create_schedule(model)
        head = sch["head"].mod
        sch["embed"].shard("weight", axis=0)
    embed, decoder_embed = sch["embed"].mod, sch["decoder_embed"].mod
    assert type(embed) is type(decoder_embed) is VocabParallelEmbedding and embed is not decoder_embed
    assert sch["head"].mod is head and type(head) is nn.Linear  # a column-parallel head keeps its class
    assert embed.weight is decoder_embed.weight is head.weight and tuple(head.weight.shape) == (6, 5)
    for m in (embed, decoder_embed):
        assert module_record(m).original_class is nn.Embedding
        assert (m.vocab_start_index, m.vocab_end_index, m.num_embeddings) == (rank * 6, rank * 6 + 6, 6)
    ids = torch.randint(0, 12, (3, 4))
    rows = slice(rank * 6, rank * 6 + 6)
    inside = ((ids >= rank * 6) & (ids < rank * 6 + 6)).unsqueeze(-1)
    expected = torch.where(inside, model.embed(ids), torch.zeros(()))
    torch.testing.assert_close(embed(ids), expected)
    torch.testing.assert_close(head(torch.ones(2, 5)), model.head(torch.ones(2, 5))[:, rows])


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 4)

    def forward(self, x):
        return self.proj(x)


@register_shard_rule
class _PairRule(ShardRule):
    module_types = (_Pair,)
    seen: list = []

    @classmethod
    def after_child_shard(cls, module, child_name, child, tensor_name, axis, world_size, rank):
        cls.seen.append((child_name, child, module.proj is child))


def test_the_parent_rule_is_given_the_replacement_already_in_place():
    _PairRule.seen.clear()
    with fake_group(2, 0):
        sch = schedlang.create_schedule(_Pair())
        old = sch["proj"].mod
        sch["proj"].shard("weight", axis=1)
    [(name, child, in_place)] = _PairRule.seen
    assert name == "proj" and child is sch["proj"].mod and child is not old and in_place
    assert type(child) is LinearWithSeparateBias


def test_a_replaced_root_goes_back_when_its_block_fails():
    emb = nn.Embedding(16, 6)
    with fake_group(2, 0):
        sch = schedlang.create_schedule(emb)
        old = sch.mod
        with pytest.raises(schedlang.ShardError, match="already sharded"):
            with sch.atomic():
                sch.shard("weight", axis=0)
                assert type(sch.mod) is VocabParallelEmbedding
                sch.shard("weight", axis=1)
    assert sch.mod is old and type(old) is nn.Embedding and old.num_embeddings == 16
    assert module_record(old) == ModuleRecord()


def test_a_meta_row_parallel_linear_builds_at_full_size_from_its_original_class():
    torch.manual_seed(0)
    full = MLP(hidden=7, inner=12)
    with schedlang.init_empty_weights():
        meta = MLP(hidden=7, inner=12)
    with fake_group(2, 1):
        sch = schedlang.create_schedule(meta)
        sch["fc2"].shard("weight", axis=1)
        assert type(sch["fc2"].mod) is LinearWithSeparateBias and sch["fc2"].mod.weight.is_meta
        torch.manual_seed(0)
        built = schedlang.build(sch, device="cpu")[0]
    assert type(built.fc2) is LinearWithSeparateBias
    torch.testing.assert_close(built.fc2.weight, full.fc2.weight[:, 6:])
    torch.testing.assert_close(built.fc2.bias, full.fc2.bias)
    torch.testing.assert_close(built.fc1.weight, full.fc1.weight)


def test_a_row_parallel_conv1d_is_a_new_module_in_place():
    from transformers.pytorch_utils import Conv1D

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_proj = Conv1D(5, 8)  # nf=5 outputs, nx=8 inputs

        def forward(self, x):
            return self.c_proj(x)

    block = Block()
    with fake_group(2, 0):
        sch = schedlang.create_schedule(block)
        old = sch["c_proj"].mod
        sch["c_proj"].shard("weight", axis=0)
    new = sch["c_proj"].mod
    assert type(new).__name__ == "RowParallelConv1D" and isinstance(new, Conv1D) and type(old) is Conv1D
    assert sch.mod.c_proj is new and new.weight is old.weight and new.bias is old.bias
    assert original_view(new) == (Conv1D, {"nx": 8, "nf": 5}) and new.nx == 4
    x = torch.randn(3, 8)
    torch.testing.assert_close(new(x[:, :4]), x[:, :4] @ block.c_proj.weight[:4] + block.c_proj.bias)


def test_a_replayed_plan_installs_the_replacement_too():
    _, sch, _ = _row_parallel_fc2(2, 1)
    with fake_group(2, 1):
        replayed = schedlang.replay(sch.plan.to_json(), MLP(hidden=7, inner=12))
    assert type(replayed["fc2"].mod) is LinearWithSeparateBias and replayed.mod.fc2 is replayed["fc2"].mod
    assert module_record(replayed["fc2"].mod) == module_record(sch["fc2"].mod)


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


def test_no_module_class_is_assigned_in_the_package():
    """A module that needs another class is replaced by a new instance (``copy_module_as``), never changed in place."""
    pattern = re.compile(r"\.__class__\s*=[^=]|setattr\([^)]*[\"']__class__[\"']")
    # a Python module made callable (``sys.modules[__name__].__class__ = ...``, as the language documents)
    # is not an nn.Module
    python_module = re.compile(r"sys\.modules\[[^]]+\]\.__class__\s*=")
    found = [f"{p.relative_to(PACKAGE.parent)}:{i}" for p in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if pattern.search(line) and not python_module.search(line)]
    assert not found, f"__class__ is assigned at {', '.join(found)}"

"""Fused tensors split in blocks of unequal widths (``ShardSpec.blocks``): Phi-3's ``qkv_proj`` with fewer
key/value heads than query heads, whose q, k and v parts are each split over the ranks.

One process plays every rank (the split needs no collectives): the slices, the fused shard of each
rank, and a meta-device build whose shards equal the slices of the unsharded build. The two-rank
``Verify`` of the whole model is in ``test_tp_families.py``.
"""

import contextlib
from unittest import mock

import pytest
import torch

import schedlang
import schedlang.distributed.groups as groups
from schedlang.distributed.sharding import ShardSpec, shard_specs, shard_tensor
from schedlang.models import shard_model
from tests.models import tp_checks as T


@contextlib.contextmanager
def fake_group(world, rank):
    with mock.patch.object(groups, "world_size", lambda group=None: world), \
            mock.patch.object(groups, "rank", lambda group=None: rank):
        yield


@pytest.mark.parametrize("blocks,world,axis", [((8, 4, 4), 2, 0), ((12, 4, 4), 4, 1), ((6, 3), 3, 0)])
def test_each_block_is_split_on_its_own(blocks, world, axis):
    full = torch.randn(sum(blocks), 7) if axis == 0 else torch.randn(5, sum(blocks))
    pieces = []
    for rank in range(world):
        spec = ShardSpec(axis, world, rank, tuple(full.shape), blocks=blocks)
        assert spec.groups == len(blocks) and spec.block_sizes(full.shape[axis]) == blocks
        piece = spec.slice_of(full)
        assert torch.equal(piece, shard_tensor(full, axis, rank, world, blocks=blocks))
        assert piece.shape[axis] == sum(blocks) // world
        pieces.append(piece)
    # block b of rank r is rows [start_b + r * size_b, ...) of the full tensor
    start = 0
    for i, block in enumerate(blocks):
        size = block // world
        offset = sum(b // world for b in blocks[:i])
        for rank, piece in enumerate(pieces):
            assert torch.equal(piece.narrow(axis, offset, size), full.narrow(axis, start + rank * size, size))
        start += block
    # equal blocks give what groups gives
    equal = ShardSpec(axis, world, 1, tuple(full.shape), groups=len(blocks))
    same = ShardSpec(axis, world, 1, tuple(full.shape), blocks=(sum(blocks) // len(blocks),) * len(blocks))
    assert sum(blocks) % len(blocks) or torch.equal(equal.slice_of(full), same.slice_of(full))


def test_meta_build_of_phi3_with_grouped_query_attention_equals_slices_of_the_unsharded_build():
    import transformers

    cfg = T.family_config("phi3_gqa")
    with schedlang.init_empty_weights():
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    torch.manual_seed(5)
    full = schedlang.build(schedlang.create_schedule(meta), device="cpu")[0]
    full_params = dict(full.named_parameters(remove_duplicate=False))
    for rank in range(2):
        with fake_group(2, rank):
            sch = schedlang.create_schedule(meta)
            shard_model(sch)
            torch.manual_seed(5)
            model = schedlang.build(sch, device="cpu")[0]
        qkv = shard_specs(model.model.layers[0].self_attn.qkv_proj)["weight"]
        assert qkv.blocks == (64, 32, 32) and model.model.layers[0].self_attn.qkv_proj.weight.shape == (64, 64)
        for mod_name, module in model.named_modules(remove_duplicate=False):
            specs = shard_specs(module)
            for name, p in module.named_parameters(recurse=False):
                ref = full_params[f"{mod_name}.{name}" if mod_name else name]
                expected = specs[name].slice_of(ref) if name in specs else ref
                assert torch.equal(p, expected), f"{mod_name}.{name} on rank {rank}"

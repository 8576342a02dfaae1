"""``build`` on meta-device models: each rank allocates only its shards, equal to the slices of the
unsharded model built from meta with the same seed.

Sharding needs no collectives, so one process plays every rank (``fake_group``) and compares
its shards with the unsharded build. Also checked: HF's own initialization (``_init_weights``,
including inits that re-initialize a submodule, GPT-2's scaled ``c_proj``), tied weights,
non-HF modules (``reset_parameters``), ``init_weights=False`` / a callable, and the errors.
"""

import contextlib
import logging
import math
from unittest import mock

import pytest
import torch
from torch import nn

import schedlang
import schedlang.distributed.groups as groups
from schedlang.models import shard_bert, shard_gpt2, shard_llama
from schedlang.module_record import shard_specs


@contextlib.contextmanager
def fake_group(world, rank):
    with mock.patch.object(groups, "world_size", lambda group=None: world), \
            mock.patch.object(groups, "rank", lambda group=None: rank):
        yield


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8,
                                        num_key_value_heads=4, intermediate_size=96, vocab_size=128,
                                        tie_word_embeddings=True))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                      bos_token_id=0, eos_token_id=0))


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=96,
                                      vocab_size=128, max_position_embeddings=32))


FAMILIES = {"llama": (_llama, shard_llama), "gpt2": (_gpt2, shard_gpt2), "bert": (_bert, shard_bert)}


def _meta(make):
    with schedlang.init_empty_weights():
        model = make()
    assert all(p.is_meta for p in model.parameters())
    return model


def _build_unsharded(meta, seed):
    torch.manual_seed(seed)
    return schedlang.build(schedlang.create_schedule(meta), device="cpu")[0]


def _build_rank(meta, shard, world, rank, seed, **options):
    with fake_group(world, rank):
        sch = schedlang.create_schedule(meta)
        shard(sch, **options)
        torch.manual_seed(seed)
        return schedlang.build(sch, device="cpu")[0]


def _bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("family,world", [("llama", 2), ("llama", 4), ("gpt2", 2), ("bert", 2), ("bert", 4)])
def test_shards_equal_slices_of_the_unsharded_build(family, world):
    make, shard = FAMILIES[family]
    meta = _meta(make)
    full = _build_unsharded(meta, seed=3)
    full_params = dict(full.named_parameters(remove_duplicate=False))
    split_bytes = 0
    for rank in range(world):
        model = _build_rank(meta, shard, world, rank, seed=3, sequence_parallel=(family == "llama"))
        assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
        checked = 0
        for mod_name, module in model.named_modules(remove_duplicate=False):
            specs = shard_specs(module)
            for name, p in module.named_parameters(recurse=False):
                ref = full_params[f"{mod_name}.{name}" if mod_name else name]
                expected = specs[name].slice_of(ref) if name in specs else ref
                assert torch.equal(p, expected), f"{mod_name}.{name} on rank {rank}"
                checked += 1
        assert checked == len(full_params)
        split_bytes += _bytes(model)
    # each rank holds 1/world of what is split: the ranks together hold the model once plus the replicas
    replicated = sum(p.numel() * p.element_size() for m in model.modules() for n, p in m.named_parameters(recurse=False)
                     if n not in shard_specs(m))
    assert split_bytes == _bytes(full) + (world - 1) * replicated
    # about 1/world: only norms (and for BERT position / token-type embeddings and the MLM transform) stay whole
    assert _bytes(model) / _bytes(full) < 1 / world + {"llama": 0.01, "gpt2": 0.02, "bert": 0.08}[family]


def test_hf_initialization_is_kept_ties_included():
    full = _build_unsharded(_meta(_gpt2), seed=0)
    assert full.lm_head.weight is full.transformer.wte.weight
    attn = full.transformer.h[0].attn
    # GPT-2 re-initializes c_proj from GPT2Attention's init, scaled by 1/sqrt(2 * n_layer)
    assert 0.9 < attn.c_proj.weight.std().item() / (0.02 / math.sqrt(4)) < 1.1
    assert 0.9 < attn.c_attn.weight.std().item() / 0.02 < 1.1
    assert attn.c_attn.bias.eq(0).all() and full.transformer.ln_f.weight.eq(1).all()
    bert = _build_unsharded(_meta(_bert), seed=0)
    preds = bert.cls.predictions
    assert preds.decoder.weight is bert.bert.embeddings.word_embeddings.weight and preds.decoder.bias is preds.bias
    assert bert.bert.embeddings.word_embeddings.weight[0].eq(0).all()  # padding row
    sharded = _build_rank(_meta(_bert), shard_bert, 2, 0, seed=0)
    preds = sharded.cls.predictions
    assert preds.decoder.weight is sharded.bert.embeddings.word_embeddings.weight and preds.decoder.bias is preds.bias


def test_same_seed_same_model_other_seed_other_model():
    meta = _meta(_llama)
    a, b, c = _build_unsharded(meta, 1), _build_unsharded(meta, 1), _build_unsharded(meta, 2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_plain_modules_use_reset_parameters():
    def mlp():
        return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 6))

    torch.manual_seed(4)
    eager = mlp()
    with schedlang.init_empty_weights():
        meta = mlp()

    def steps(s):
        s["0"].shard("weight", axis=0)
        s["0"].shard("bias", axis=0)
        s["2"].shard("weight", axis=1)

    for rank in range(2):
        with fake_group(2, rank):
            sch = schedlang.create_schedule(meta)
            steps(sch)
            torch.manual_seed(4)
            model = schedlang.build(sch, device="cpu")[0]  # the CPU generator, as the eager model used
        torch.testing.assert_close(model[0].weight, eager[0].weight[rank * 8:(rank + 1) * 8], rtol=0, atol=0)
        torch.testing.assert_close(model[2].weight, eager[2].weight[:, rank * 8:(rank + 1) * 8], rtol=0, atol=0)
        torch.testing.assert_close(model[2].bias, eager[2].bias, rtol=0, atol=0)


def test_init_weights_false_and_callable():
    meta = _meta(_llama)
    with fake_group(2, 0):
        sch = schedlang.create_schedule(meta)
        shard_llama(sch)
        model = schedlang.build(sch, init_weights=False, device="cpu")[0]
    assert model.lm_head.weight.shape == (64, 64) and not model.lm_head.weight.is_meta

    def constant(module):
        for p in module.parameters(recurse=False):
            nn.init.constant_(p, 0.5)

    model = schedlang.build(schedlang.create_schedule(meta), init_weights=constant, device="cpu")[0]
    assert all(p.eq(0.5).all() for p in model.parameters())


class _WritesPartOfChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = nn.Linear(4, 4)

    def reset_parameters(self):
        with torch.no_grad():
            self.child.weight[0].fill_(1.0)


class _NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_build_errors_and_warnings(caplog):
    with schedlang.init_empty_weights():
        meta = _WritesPartOfChild()
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"build: the init of _WritesPartOfChild writes only part of 'child.weight' \(a tensor of "
                             r"one of its submodules\), which cannot be rebuilt from a shard"):
        schedlang.build(schedlang.create_schedule(meta))
    with schedlang.init_empty_weights():
        meta = _NoInit()
    with caplog.at_level(logging.WARNING, logger="schedlang.build"):
        model = schedlang.build(schedlang.create_schedule(meta))[0]
    assert model.scale.eq(0).all()
    assert "_NoInit's init did not set 'scale'; it is initialized to zeros" in caplog.text

"""Tensor-parallel GPT-2 (transformers 5.x, HF Conv1D projections) with ``schedlang.models.gpt2.shard_gpt2``.

The fused q|k|v projection ``c_attn`` is split head-wise (rank r holds q_r, k_r and v_r), the LM
head stays tied to the vocabulary-parallel word embeddings, and logits, loss and every gradient
equal the single-device model's.
"""

import copy

import pytest
import torch

import schedlang
from schedlang.models.gpt2 import shard_gpt2
from schedlang.module_record import shard_specs
from tests.helpers.distributed import run_distributed
from tests.models import tp_checks as T

SEQ = 10


def _inputs():
    ids = torch.randint(0, T.VOCAB, (3, SEQ), device=T.device())
    labels = ids.clone()
    labels[1, 4:] = -100
    return ids, labels


def _model():
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(T.gpt2_config()).to(T.device())


def _tp_vocab_parallel_loss():
    model = _model()
    ids, labels = _inputs()
    sch = schedlang.create_schedule(model)
    shard_gpt2(sch)
    built, _ = schedlang.build(sch)
    result = T.compare(built, copy.deepcopy(model), {"input_ids": ids, "labels": labels}, logits_split=True)
    attn = built.transformer.h[0].attn
    result.update(split_size=attn.split_size, num_heads=attn.num_heads, c_attn_groups=shard_specs(attn.c_attn)[
        "weight"].groups, tied=built.lm_head.weight is built.transformer.wte.weight,
        n_params=len(list(model.named_parameters(remove_duplicate=False))))
    return result


def _verify_and_gathered_logits():
    model = _model()
    ids, labels = _inputs()
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]):
        shard_gpt2(sch, gather_logits=True)
    built, _ = schedlang.build(sch)
    return T.compare(built, copy.deepcopy(model), {"input_ids": ids, "labels": labels}, logits_split=False)


def _verify_catches_wrong_axis():
    model = _model()
    ids, _ = _inputs()
    sch = schedlang.create_schedule(model)
    try:
        with schedlang.Verify(sch, example_inputs=[ids]):
            mlp = sch["transformer.h.1.mlp"]
            mlp["c_fc"].shard("weight", axis=0)  # wrong: Conv1D's outputs are along axis 1
            mlp["c_proj"].shard("weight", axis=0)
            mlp["c_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
            mlp.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    except schedlang.VerificationError as e:
        return str(e)
    return None


def _meta_build():
    from transformers import GPT2LMHeadModel

    with schedlang.init_empty_weights():
        meta = GPT2LMHeadModel(T.gpt2_config())
    sch = schedlang.create_schedule(meta)
    shard_gpt2(sch)
    torch.manual_seed(11)
    sharded, _ = schedlang.build(sch, device=T.device())
    torch.manual_seed(11)
    full, _ = schedlang.build(schedlang.create_schedule(meta), device=T.device())
    ids, labels = _inputs()
    result = T.compare(sharded, full, {"input_ids": ids, "labels": labels}, logits_split=True)
    replicated = sum(p.numel() * p.element_size() for n, p in full.named_parameters()
                     if n.startswith("transformer.wpe") or ".ln_" in n or n.endswith(("c_proj.bias",)))
    result["bytes"] = (T.param_bytes(sharded), T.param_bytes(full), replicated)
    return result


def _world2(rank, world):
    return T.run_scenarios({"tp": _tp_vocab_parallel_loss, "verify": _verify_and_gathered_logits,
                            "wrong_axis": _verify_catches_wrong_axis, "meta": _meta_build})


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2, world_size=2, timeout=240)


def test_logits_loss_and_gradients_match_single_device(world2):
    for r in T.value(world2, "tp"):
        T.assert_matches(r)
        assert r["local_vocab"] == T.VOCAB // 2
        assert r["grads_compared"] == r["n_params"]
        assert (r["split_size"], r["num_heads"], r["c_attn_groups"]) == (T.HIDDEN // 2, 2, 3)
        assert r["tied"] is True


def test_verify_passes_with_gathered_logits(world2):
    for r in T.value(world2, "verify"):
        T.assert_matches(r)


def test_verify_catches_wrong_shard_axis(world2):
    for m in T.value(world2, "wrong_axis"):
        assert m is not None, "Verify accepted c_fc split along its inputs"
        assert "does not match the original model" in m
        assert "shard at 'transformer.h.1.mlp.c_fc' (tensor_name='weight', axis=0)" in m


def test_meta_build_holds_half_of_the_split_parameters(world2):
    for r in T.value(world2, "meta"):
        T.assert_matches(r)
        sharded, full, replicated = r["bytes"]
        assert sharded == (full - replicated) // 2 + replicated
        assert sharded / full < 0.53

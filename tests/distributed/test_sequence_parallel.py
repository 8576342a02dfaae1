"""Sequence parallelism (Megatron-SP): norms on sequence shards, reduce-scatter / all-gather along the sequence.

One process checks the sequence-parallel norms' construction and errors; two gloo ranks check
that norms on sequence shards give the full outputs and full weight gradients, and that the
LLaMA, GPT-2 and BERT schedules with ``sequence_parallel=True`` equal the single-device models
(``Verify`` with gathered logits, and loss / gradients with split logits). The automatic plan
(``shard_model`` / ``shard_auto``) is checked the same way on LLaMA, GPT-NeoX and OPT (whose layer
flattens the tokens before its MLP), and a sequence length the ranks cannot split is refused.
"""

import copy

import pytest
import torch
from torch import nn

import schedlang
from schedlang.distributed.collectives import gather_forward, scatter_forward
from schedlang.distributed.sequence_parallel import (SplitSequence, is_sequence_parallel_norm,
                                                     make_sequence_parallel_norm, sequence_parallel_norms)
from tests.helpers.distributed import run_distributed
from tests.models import tp_checks as T


def _llama_norm(hidden):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm


def _norms(hidden=24):
    layer_norm = nn.LayerNorm(hidden)
    with torch.no_grad():
        layer_norm.weight.uniform_(0.5, 1.5)
        layer_norm.bias.uniform_(-0.5, 0.5)
    rms = nn.RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
    return {"LayerNorm": layer_norm, "RMSNorm": rms, "LlamaRMSNorm": _llama_norm(hidden)}


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm", "LlamaRMSNorm"])
def test_sequence_parallel_norm_shares_parameters_and_computes_the_same(kind):
    norm = _norms()[kind]
    sp = make_sequence_parallel_norm("layers.0.norm", norm)
    assert is_sequence_parallel_norm(sp) and not is_sequence_parallel_norm(norm)
    assert isinstance(sp, type(norm)) and type(sp).__name__ == f"SequenceParallel{type(norm).__name__}"
    assert all(a is b for a, b in zip(sp.parameters(), norm.parameters()))
    assert make_sequence_parallel_norm("x", sp) is sp
    x = torch.randn(3, 7, 24, requires_grad=True)
    expected = norm(x)
    (expected * expected.detach()).sum().backward()
    grads = [p.grad.clone() for p in norm.parameters()]
    for p in norm.parameters():
        p.grad = None
    x2 = x.detach().clone().requires_grad_(True)
    out = sp(x2)  # one process: the gradient sum over the group is the identity
    (out * out.detach()).sum().backward()
    torch.testing.assert_close(out, expected)
    for p, g in zip(sp.parameters(), grads):
        torch.testing.assert_close(p.grad, g)


def test_copies_share_the_group_and_unsupported_norms_are_refused():
    sp = make_sequence_parallel_norm("n", nn.LayerNorm(8))
    assert copy.deepcopy(sp).__dict__["_schedlang_sequence_parallel_group"] is sp.__dict__[
        "_schedlang_sequence_parallel_group"]
    with pytest.raises(schedlang.ScheduleTypeError,
                       match=r"layers.0.norm: no sequence-parallel form for GroupNorm; supported norms: nn.LayerNorm, "
                             r"nn.RMSNorm, LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm"):
        make_sequence_parallel_norm("layers.0.norm", nn.GroupNorm(2, 8))


def test_sequence_parallel_norms_step_replaces_only_the_selected_norms():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Sequential(nn.LayerNorm(8)))
    sch = schedlang.create_schedule(model)
    replaced = sequence_parallel_norms(sch, nn.LayerNorm, only=lambda path: path != "1")
    assert replaced == ["1", "2.0"]
    assert not is_sequence_parallel_norm(sch["1"].mod) and is_sequence_parallel_norm(sch["2.0"].mod)
    assert sch.plan[0].primitive == "replace_all"
    assert repr(SplitSequence(axis=1)) == "SplitSequence(axis=1, world_size=1)"


# --------------------------------------------------------------------------- two ranks
def _norms_on_sequence_shards():
    out = {}
    for kind, norm in _norms().items():
        norm = norm.to(T.device())
        x = torch.randn(2, 10, 24, device=T.device())
        ref = copy.deepcopy(norm)
        xr = x.clone().requires_grad_(True)
        expected = ref(xr)
        cot = torch.randn(expected.shape, device=T.device())
        (expected * cot).sum().backward()
        sp = make_sequence_parallel_norm("norm", norm)
        xs = x.clone().requires_grad_(True)
        full = gather_forward(sp(scatter_forward(xs, 1)), 1)
        (full * cot).sum().backward()
        out[kind] = (float((full - expected).abs().max()), float((xs.grad - xr.grad).abs().max()),
                     max(float((p.grad - q.grad).abs().max()) for p, q in zip(sp.parameters(), ref.parameters())))
    return out


def _verify_and_compare(shard, make, labels_loss=True, seq=12):
    def run():
        model = make().to(T.device())
        ids = torch.randint(2, T.VOCAB, (2, seq), device=T.device())
        sch = schedlang.create_schedule(model)
        with schedlang.Verify(sch, example_inputs=[ids]):
            plan = shard(sch, sequence_parallel=True, gather_logits=True)
        sch = schedlang.create_schedule(model)
        shard(sch, sequence_parallel=True)
        built, _ = schedlang.build(sch)
        if labels_loss:
            labels = ids.clone()
            labels[0, :3] = -100
            result = T.compare(built, copy.deepcopy(model), {"input_ids": ids, "labels": labels}, logits_split=True)
            result["plan"] = str(plan)
            return result
        from schedlang.distributed.cross_entropy import vocab_parallel_cross_entropy

        def loss(out, full):
            if full:
                return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids.flatten())
            return vocab_parallel_cross_entropy(out.logits, ids)

        return T.compare(built, copy.deepcopy(model), {"input_ids": ids}, logits_split=True, loss_fn=loss)

    return run


def _odd_sequence_length():
    from schedlang.models import shard_model

    model = T.family_model("opt")[0].to(T.device())
    sch = schedlang.create_schedule(model)
    shard_model(sch, sequence_parallel=True)
    built, _ = schedlang.build(sch)
    try:
        built(input_ids=torch.randint(2, T.VOCAB, (2, 11), device=T.device()))
    except schedlang.ScheduleValueError as e:
        return str(e)
    return None


def _two_ranks(rank, world):
    from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM

    from schedlang.models import shard_auto, shard_bert, shard_gpt2, shard_llama, shard_model

    return T.run_scenarios({
        "norms": _norms_on_sequence_shards,
        "llama": _verify_and_compare(shard_llama, lambda: LlamaForCausalLM(T.llama_config())),
        "gpt2": _verify_and_compare(shard_gpt2, lambda: GPT2LMHeadModel(T.gpt2_config())),
        "bert": _verify_and_compare(shard_bert, lambda: BertForMaskedLM(T.bert_config()), labels_loss=False,
                                    seq=10),
        "auto_llama": _verify_and_compare(shard_auto, lambda: LlamaForCausalLM(T.llama_config())),
        "auto_gpt_neox": _verify_and_compare(shard_model, lambda: T.family_model("gpt_neox")[0], seq=10),
        "auto_opt": _verify_and_compare(shard_model, lambda: T.family_model("opt")[0]),
        "odd_length": _odd_sequence_length,
    })


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_two_ranks, world_size=2, timeout=240)


def test_norms_on_sequence_shards_give_full_outputs_and_weight_gradients(two_ranks):
    for per_rank in T.value(two_ranks, "norms"):
        for kind, (out_diff, input_grad_diff, weight_grad_diff) in per_rank.items():
            assert out_diff <= 1e-5, kind
            assert input_grad_diff <= 1e-5, kind
            assert weight_grad_diff <= 1e-4, kind  # sums over 20 tokens, compared with the unsplit sum


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_sequence_parallel_schedules_match_single_device(two_ranks, family):
    for r in T.value(two_ranks, family):
        assert r["logits"] <= 2e-5 * max(1.0, r["logits_scale"]), r
        assert r["loss"] <= 2e-5, r
        assert r["grad"] <= 2e-5, r


@pytest.mark.parametrize("family", ["auto_llama", "auto_gpt_neox", "auto_opt"])
def test_automatic_plan_with_sequence_parallelism_matches_single_device(two_ranks, family):
    for r in T.value(two_ranks, family):
        T.assert_matches(r)
        assert r["local_vocab"] == T.VOCAB // 2
        plan = r["plan"]
        assert plan.startswith("tensor-parallel plan for ") and ", sequence parallel)" in plan, plan
        assert "reduce-scattered along the sequence" in plan and "weight gradients summed: " in plan, plan
        assert "keeps each rank's slice of the sequence" in plan, plan


def test_a_sequence_the_ranks_cannot_split_is_refused(two_ranks):
    for message in T.value(two_ranks, "odd_length"):
        assert message == (
            "model.decoder.layers.0: sequence parallelism splits axis 1 of the input (shape (2, 11, 64)) over 2 "
            "ranks, but its length 11 is not divisible by 2; pad the sequence to a multiple of 2 (e.g. 10 or 12) "
            "or shard without sequence_parallel"), message

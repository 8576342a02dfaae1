"""Vocabulary-parallel cross entropy against ``F.cross_entropy`` of the full logits.

One process (no group: the whole vocabulary on one rank) checks the arithmetic and the errors;
two gloo ranks, each holding half of the vocabulary, check the collectives: loss and the
gradient of every rank's logits (the matching columns of the full gradient).
"""

import pytest
import torch
import torch.nn.functional as F

import schedlang
from schedlang.distributed.cross_entropy import (VocabParallelCausalLMLoss, VocabParallelMaskedLMLoss,
                                                 use_vocab_parallel_loss, vocab_parallel_cross_entropy)
from tests.helpers.distributed import run_distributed

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2}


def _problem(tokens, vocab, dtype, ignore_every=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::ignore_every] = -100
    return logits, labels


def _reference(logits, labels, reduction="mean", ignore_index=-100):
    full = logits.detach().to(torch.float64 if logits.dtype == torch.float64 else torch.float32).requires_grad_(True)
    loss = F.cross_entropy(full, labels, ignore_index=ignore_index, reduction=reduction)
    return loss, full


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 13), (1000, 61), (16, 128)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_single_rank_equals_cross_entropy(shape, dtype, reduction):
    logits, labels = _problem(*shape, dtype)
    logits.requires_grad_(True)
    loss = vocab_parallel_cross_entropy(logits, labels, reduction=reduction)
    ref, full = _reference(logits, labels, reduction)
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (loss * cot).sum().backward()
    (ref * cot).sum().backward()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(loss, ref.to(loss.dtype), rtol=tol, atol=tol)
    assert logits.grad.dtype == dtype
    # relative to the gradient's largest entry: a mean over many tokens makes every entry far below 1
    scale = full.grad.abs().max()
    torch.testing.assert_close(logits.grad.to(full.dtype) / scale, full.grad / scale, rtol=0, atol=tol)


def test_leading_dimensions_and_custom_ignore_index():
    logits, labels = _problem(2 * 9, 50, torch.float32)
    labels[labels == -100] = 7
    loss = vocab_parallel_cross_entropy(logits.view(2, 9, 50), labels.view(2, 9), ignore_index=7)
    ref, _ = _reference(logits, labels, ignore_index=7)
    torch.testing.assert_close(loss, ref)


def test_all_tokens_ignored_gives_nan_like_cross_entropy():
    logits, labels = _problem(4, 10, torch.float32)
    labels[:] = -100
    assert torch.isnan(vocab_parallel_cross_entropy(logits, labels))
    assert torch.isnan(F.cross_entropy(logits, labels))


def test_causal_lm_loss_shifts_labels_like_hf():
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits, labels = _problem(2 * 11, 40, torch.float32)
    logits, labels = logits.view(2, 11, 40), labels.view(2, 11)
    ours = VocabParallelCausalLMLoss()(logits, labels, vocab_size=40)
    torch.testing.assert_close(ours, ForCausalLMLoss(logits, labels, vocab_size=40))
    n = torch.tensor(5.0)
    torch.testing.assert_close(VocabParallelCausalLMLoss()(logits, labels, vocab_size=40, num_items_in_batch=n),
                               ForCausalLMLoss(logits, labels, vocab_size=40, num_items_in_batch=n))


def test_masked_lm_loss_does_not_shift():
    logits, labels = _problem(3 * 8, 30, torch.float32)
    ours = VocabParallelMaskedLMLoss()(logits.view(3, 8, 30), labels.view(3, 8), vocab_size=30)
    torch.testing.assert_close(ours, F.cross_entropy(logits, labels))


def test_use_vocab_parallel_loss_replaces_the_hf_loss_function():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                         intermediate_size=64, vocab_size=50))
    ids = torch.randint(0, 50, (2, 7))
    expected = model(input_ids=ids, labels=ids).loss
    assert use_vocab_parallel_loss(model) is model
    assert isinstance(model.loss_function, VocabParallelCausalLMLoss)
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, expected)
    sch = schedlang.create_schedule(model)
    use_vocab_parallel_loss(sch, kind="masked")
    assert isinstance(sch.mod.loss_function, VocabParallelMaskedLMLoss)


def test_errors():
    logits, labels = _problem(6, 10, torch.float32)
    with pytest.raises(schedlang.ScheduleValueError, match=r"invalid reduction 'avg': valid are mean, sum, none"):
        vocab_parallel_cross_entropy(logits, labels, reduction="avg")
    with pytest.raises(schedlang.ScheduleTypeError, match=r"logits must be floating point, got torch.int64"):
        vocab_parallel_cross_entropy(labels.view(2, 3), labels[:2])
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"labels of shape \(5,\) do not match logits of shape \(6, 10\): labels need the "
                             r"logits' shape without the last \(vocabulary\) axis"):
        vocab_parallel_cross_entropy(logits, labels[:5])
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"VocabParallelCausalLMLoss: logits have 10 vocabulary columns on each of 1 ranks "
                             r"\(10 in all\) but the model's vocabulary has 20"):
        VocabParallelCausalLMLoss()(logits.view(1, 6, 10), labels.view(1, 6), vocab_size=20)
    with pytest.raises(schedlang.ScheduleTypeError,
                       match=r"use_vocab_parallel_loss: Linear has no HF loss_function to replace; call "
                             r"vocab_parallel_cross_entropy\(logits, labels\)"):
        use_vocab_parallel_loss(torch.nn.Linear(2, 2))
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=20, n_positions=8,
                                      bos_token_id=0, eos_token_id=0))
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"use_vocab_parallel_loss: invalid kind 'seq2seq': valid kinds are causal, masked"):
        use_vocab_parallel_loss(gpt2, kind="seq2seq")


# --------------------------------------------------------------------------- two ranks
def _two_ranks(rank, world):
    from tests.models.tp_checks import device

    dev = device()  # NCCL needs the rank's GPU
    out = {}
    for tokens, vocab, dtype in [(37, 122, torch.float32), (1000, 64, torch.float32), (50, 256, torch.bfloat16)]:
        logits, labels = (t.to(dev) for t in _problem(tokens, vocab, dtype, ignore_every=4, seed=tokens))
        local = logits[:, rank * vocab // world:(rank + 1) * vocab // world].clone().requires_grad_(True)
        for reduction in ("mean", "sum", "none"):
            loss = vocab_parallel_cross_entropy(local, labels, reduction=reduction)
            ref, full = _reference(logits, labels, reduction)
            cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2)).to(dev)
            local.grad = None
            (loss * cot).sum().backward()
            (ref * cot).sum().backward()
            expected_grad = full.grad[:, rank * vocab // world:(rank + 1) * vocab // world]
            out[(tokens, vocab, str(dtype), reduction)] = (
                float((loss.float() - ref).abs().max()),
                # relative to the largest entry of the full gradient (a mean over many tokens: all far below 1)
                float((local.grad.float() - expected_grad).abs().max() / full.grad.abs().max()),
                local.grad.dtype == dtype)
    # the HF wrapper with split logits: (batch, seq, vocab / world)
    logits, labels = (t.to(dev) for t in _problem(3 * 10, 90, torch.float32, seed=3))
    local = logits.view(3, 10, 90)[..., rank * 45:(rank + 1) * 45]
    from transformers.loss.loss_utils import ForCausalLMLoss

    out["causal"] = float((VocabParallelCausalLMLoss()(local, labels.view(3, 10), vocab_size=90)
                           - ForCausalLMLoss(logits.view(3, 10, 90), labels.view(3, 10), vocab_size=90)).abs())
    try:
        VocabParallelCausalLMLoss()(local, labels.view(3, 10), vocab_size=100)
        out["mismatch"] = None
    except schedlang.ScheduleValueError as e:
        out["mismatch"] = str(e)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_two_ranks, world_size=2, timeout=180)


def test_two_ranks_equal_cross_entropy_of_the_gathered_logits(two_ranks):
    for per_rank in two_ranks:
        for (tokens, vocab, dtype, reduction), (loss_diff, grad_diff, same_dtype) in (
                (k, v) for k, v in per_rank.items() if isinstance(k, tuple)):
            tol = 2e-2 if "bfloat16" in dtype else 1e-5
            assert loss_diff <= tol * (tokens if reduction == "sum" else 1), (tokens, vocab, dtype, reduction)
            assert grad_diff <= tol, (tokens, vocab, dtype, reduction)
            assert same_dtype


def test_two_ranks_causal_lm_loss(two_ranks):
    for per_rank in two_ranks:
        assert per_rank["causal"] <= 1e-5
        assert per_rank["mismatch"].startswith(
            "VocabParallelCausalLMLoss: logits have 45 vocabulary columns on each of 2 ranks (90 in all) but the "
            "model's vocabulary has 100")

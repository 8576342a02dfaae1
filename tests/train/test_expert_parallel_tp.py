"""The trainer with ``--ep`` beside ``--tp --sp``: tensor parallelism splits attention and the dense MLPs (a shared
expert too), the experts stay whole on every tp rank and are spread over the data-parallel ranks of each tp rank,
each tp rank routing its own sequence slice. At ``--nproc 4 --dp 2 --tp 2 --sp --ep 2`` a tiny Qwen3-MoE and a
tiny Qwen2-MoE (a shared expert and its gate) train as one process does (losses and gradient norms); the load
metrics count each expert's tokens over every tp rank (those of ``--dp 2 --ep 2``); a checkpoint saved under
ep 2 x tp 2 resumes in one process, and ``--export-hf`` writes the full experts; ``--tp`` without ``--sp`` is
refused."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.trainer_runs import assert_same_steps as _assert_same, run_metrics
from tests.train.test_expert_parallel import CONFIG, _common

pytest.importorskip("transformers")

#: Qwen2-MoE: routed experts beside a shared expert (an MLP, split by tp) with its own sigmoid gate
QWEN2_MOE = {"model_type": "qwen2_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
             "intermediate_size": 48, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
             "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False, "pad_token_id": 0,
             "bos_token_id": 1, "eos_token_id": 2}

EP_TP = ("--nproc", "4", "--dp", "2", "--tp", "2", "--sp", "--ep", "2")


def _run(tmp, name: str, *flags: str, config: str = "config.json", model=()):
    return run_metrics(_common(tmp / config) + list(model) + list(flags), tmp / f"{name}.jsonl")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_ep_tp")
    (tmp / "config.json").write_text(json.dumps(CONFIG))
    return tmp


@pytest.fixture(scope="module")
def reference(work):
    return _run(work, "single")


def test_ep2_tp2_trains_like_one_process_counts_load_over_tp_and_exports(reference, work):
    records = _run(work, "ep2-tp2", *EP_TP, "--export-hf", str(work / "hf"))
    _assert_same(records, reference)
    # each tp rank routes half of every sequence: an expert's load is the sum over the tp ranks, which is what the
    # experts see without tensor parallelism (the same weights and tokens at step 1 route the same way)
    ep_only = _run(work, "ep2", "--nproc", "2", "--dp", "2", "--ep", "2")
    assert (records[0]["tokens_per_expert_min"], records[0]["tokens_per_expert_max"]) == \
        (ep_only[0]["tokens_per_expert_min"], ep_only[0]["tokens_per_expert_max"])

    import transformers

    _run(work, "single-export", "--export-hf", str(work / "hf-single"))
    spread = transformers.AutoModelForCausalLM.from_pretrained(str(work / "hf"))
    whole = transformers.AutoModelForCausalLM.from_pretrained(str(work / "hf-single"))
    assert spread.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 32, 32)
    ids = torch.randint(3, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(spread(ids).logits, whole(ids).logits, rtol=1e-4, atol=1e-5)


def test_ep2_tp2_checkpoint_resumes_in_one_process(reference, work):
    ckpt = work / "ckpt-ep2-tp2"
    first = _run(work, "stop-ep2-tp2", *EP_TP, "--checkpoint-dir", str(ckpt), "--stop-after", "2")
    assert [r["step"] for r in first] == [1, 2]
    _assert_same(first, reference)
    resumed = _run(work, "resume-single", "--checkpoint-dir", str(ckpt), "--resume")
    assert [r["step"] for r in resumed] == [3]
    _assert_same(resumed, reference)


def test_shared_expert_family_trains_like_one_process(work):
    config = work / "qwen2_moe.json"
    config.write_text(json.dumps(QWEN2_MOE))

    def run(name, *flags):
        return _run(work, name, *flags, config="qwen2_moe.json", model=("--model", "qwen2_moe"))

    _assert_same(run("qwen2-ep2-tp2", *EP_TP), run("qwen2-single"))


def test_tp_without_sp_is_refused(work, capsys):
    from schedlang import train as trainer

    flags = _common(work / "config.json") + ["--nproc", "4", "--dp", "2", "--tp", "2", "--ep", "2", "--dry-run"]
    assert trainer.main(flags) != 0
    assert ("--ep 2 with --tp 2 needs --sp: the experts stay whole on every tp rank and each tp rank routes its own "
            "sequence slice through them") in capsys.readouterr().err

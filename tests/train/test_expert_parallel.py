"""The trainer with ``--ep``: a tiny Qwen3-MoE trains as one process does (losses and gradient norms) with ep
alone, beside FSDP2 and DDP at world 4; a checkpoint saved under ep 2 resumes under ep 1 and one saved under
ep 1 under ep 2, exactly; ``--export-hf`` writes the full experts, which transformers loads; the load metrics
appear; flags that cannot work are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from schedlang import train as trainer
from tests.helpers.trainer_runs import assert_same_steps, run_metrics

pytest.importorskip("transformers")

#: 8 experts of 2 layers, 2 chosen per token; irregular sizes (hidden 32, 16-wide experts, vocab 64)
CONFIG = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "moe_intermediate_size": 16, "intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
          "norm_topk_prob": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _common(config: Path):
    return ["--model", "qwen3_moe", "--config", str(config), "--steps", "3", "--global-batch", "4", "--seq", "16",
            "--lr", "3e-3", "--device", "cpu", "--dtype", "fp32", "--seed", "7"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_ep")
    (tmp / "config.json").write_text(json.dumps(CONFIG))
    return tmp


def _run(tmp: Path, name: str, *flags: str):
    return run_metrics(_common(tmp / "config.json") + list(flags), tmp / f"{name}.jsonl")


_assert_same = assert_same_steps


@pytest.fixture(scope="module")
def reference(work):
    return _run(work, "single")


@pytest.fixture(scope="module")
def ep2(work):
    return _run(work, "ep2", "--nproc", "2", "--dp", "2", "--ep", "2", "--export-hf", str(work / "hf"))


def _load(records):
    return [(r["tokens_per_expert_min"], r["tokens_per_expert_max"]) for r in records]


def test_ep2_trains_like_one_process_resumes_under_ep1_and_exports(reference, ep2, work):
    records = ep2
    _assert_same(records, reference)
    assert "tokens_per_expert_min" not in reference[0]
    for r in records:  # 4 x 15 tokens, 2 choices each, over 2 blocks of 8 experts: every count within [0, 120]
        assert 0 <= r["tokens_per_expert_min"] <= r["tokens_per_expert_max"] <= 120
        assert r["tokens_per_expert_min"] < r["tokens_per_expert_max"]
    ckpt = work / "ckpt-ep2"
    first = _run(work, "stop-ep2", "--nproc", "2", "--dp", "2", "--ep", "2", "--checkpoint-dir", str(ckpt),
                 "--stop-after", "2")
    assert [r["step"] for r in first] == [1, 2]
    resumed = _run(work, "resume-ep1", "--checkpoint-dir", str(ckpt), "--resume")
    assert [r["step"] for r in resumed] == [3]
    _assert_same(resumed, reference)

    # the export holds the full experts under transformers' names: its logits are those of one process's model
    # trained the same way (exported with --export-hf from the single-process run)
    import transformers

    _run(work, "single-export", "--export-hf", str(work / "hf-single"))
    spread = transformers.AutoModelForCausalLM.from_pretrained(str(work / "hf"))
    whole = transformers.AutoModelForCausalLM.from_pretrained(str(work / "hf-single"))
    assert spread.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8
    ids = torch.randint(3, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(spread(ids).logits, whole(ids).logits, rtol=1e-4, atol=1e-5)


def test_ep1_checkpoint_resumes_under_ep2_with_ddp(reference, work):
    ckpt = work / "ckpt-ep1"
    _run(work, "stop-dp2", "--nproc", "2", "--dp", "2", "--checkpoint-dir", str(ckpt), "--stop-after", "2")
    resumed = _run(work, "resume-ep2", "--nproc", "2", "--dp", "2", "--ep", "2", "--dp-mode", "ddp",
                   "--checkpoint-dir", str(ckpt), "--resume")
    assert [r["step"] for r in resumed] == [3]
    _assert_same(resumed, reference)


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_dp4_ep2_trains_like_one_process(reference, work, mode):
    # two expert-parallel groups of two ranks; the experts' FSDP2 / DDP runs on the two ranks holding the same
    # experts, their gradients divided by all four data-parallel ranks
    _assert_same(_run(work, f"dp4-ep2-{mode}", "--nproc", "4", "--dp", "4", "--ep", "2", "--dp-mode", mode),
                 reference)


def test_the_load_counts_every_microbatch_and_every_stage_once(reference, ep2, work):
    # the same tokens routed by the same weights: the step's counts do not depend on how the step is cut into
    # microbatches, on pipeline stages holding one block each, nor on checkpointing's second forward
    accumulated = _run(work, "ep2-mb2-ac", "--nproc", "2", "--dp", "2", "--ep", "2", "--microbatches", "2",
                       "--activation-checkpoint", "full")
    _assert_same(accumulated, reference)
    assert _load(accumulated) == _load(ep2)
    staged = _run(work, "pp2-ep2", "--nproc", "4", "--dp", "2", "--pp", "2", "--ep", "2", "--microbatches", "2")
    _assert_same(staged, reference)
    assert _load(staged) == _load(ep2)


@pytest.mark.parametrize("flags,whole_batch", [
    # expert parallelism carved from data and context parallelism together: 4 ranks, each with 2 of 8 experts;
    # one expert-parallel group sees the whole batch, as the two ranks of --dp 2 --ep 2 do
    (("--nproc", "4", "--dp", "2", "--cp", "2", "--ep", "4"), True),
    # HSDP: the experts' FSDP2 shards inside each replica group and the replicas sum; a group sees half the rows
    (("--nproc", "4", "--dp", "4", "--dp-mode", "hsdp", "--dp-replicate", "2", "--dp-shard", "2", "--ep", "2"), False),
], ids=["cp2-ep4", "hsdp-ep2"])
def test_ep_with_context_parallelism_and_hsdp_trains_like_one_process(reference, ep2, work, flags, whole_batch):
    records = _run(work, "-".join(flags[3::2]), *flags)
    _assert_same(records, reference)
    if whole_batch:
        assert _load(records) == _load(ep2)
    else:  # each group's busiest expert got fewer rows than the whole batch's busiest
        assert all(0 <= low <= high < whole[1] for (low, high), whole in zip(_load(records), _load(ep2)))


@pytest.mark.parametrize("flags,message", [
    (["--nproc", "4", "--dp", "4", "--ep", "3"],
     "--ep 3: expert parallelism is carved from the data-parallel ranks, --dp 4 = 4, which 3 does not divide; "
     "valid --ep: 1, 2, 4"),
    (["--nproc", "4", "--dp", "2", "--tp", "2", "--ep", "2"],
     "--ep 2 with --tp 2 needs --sp: the experts stay whole on every tp rank"),
    (["--nproc", "2", "--dp", "2", "--ep", "0"], "--ep must be at least 1, got 0"),
])
def test_flags_that_cannot_work_are_named(work, flags, message, capsys):
    assert trainer.main(_common(work / "config.json") + flags + ["--dry-run"]) != 0
    assert message in capsys.readouterr().err


def test_dense_model_and_uneven_experts_are_refused(work, capsys):
    dense = ["--model", "llama", "--config", "tiny", "--device", "cpu", "--nproc", "2", "--dp", "2", "--ep", "2",
             "--dry-run"]
    assert trainer.main(dense) != 0
    assert "--ep 2: llama tiny is a dense model" in capsys.readouterr().err
    six = dict(CONFIG, num_experts=6)
    (work / "six.json").write_text(json.dumps(six))
    flags = _common(work / "six.json") + ["--nproc", "4", "--dp", "4", "--ep", "4", "--dry-run"]
    assert trainer.main(flags) != 0
    assert ("--ep 4: the model's blocks hold 6 experts, which do not split over 4 ranks; --ep must divide 6 and --dp "
            "x --cp = 4: valid 1, 2") in capsys.readouterr().err

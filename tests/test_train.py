"""The trainer (``python -m schedlang.train`` / ``schedlang train``).

Every layout trains the tiny LLaMA for 4 fp32 steps on the same deterministic batches from the same
initial weights, and must report the losses of one process (read back from ``--metrics``). Resuming
from a checkpoint continues the uninterrupted run exactly, under the same or another layout, and
HF exports of runs under different layouts give the same logits in transformers. Local ranks are
spawned by the trainer itself (``--nproc``, gloo).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from schedlang import cli
from schedlang import train as trainer
from tests.helpers.hf_models import llama_config

STEPS = 4
COMMON = ["--model", "llama", "--config", "tiny", "--steps", str(STEPS), "--global-batch", "4", "--seq", "32",
          "--lr", "3e-3", "--device", "cpu", "--dtype", "fp32", "--seed", "5"]


def _run(tmp: Path, name: str, *flags: str, expect: int = 0):
    metrics = tmp / f"{name}.jsonl"
    args = COMMON + ["--metrics", str(metrics)] + list(flags)
    code = trainer.main(args)
    assert code == expect, f"trainer exited {code} for {args}"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if expect == 0 else None


def _losses(records):
    return {r["step"]: r["loss"] for r in records}


def _assert_same_losses(records, reference):
    got, ref = _losses(records), _losses(reference)
    assert sorted(got) == sorted(ref)
    torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)]), torch.tensor([ref[s] for s in sorted(ref)]),
                               rtol=1e-5, atol=1e-5)
    # the clipped global gradient norm counts every shard once, whatever the layout
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in records]),
                               torch.tensor([r["grad_norm"] for r in reference if r["step"] in got]),
                               rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def reference(work):
    """One process, all 4 steps."""
    return _run(work, "single")


def test_single_process_metrics(reference):
    assert [r["step"] for r in reference] == [1, 2, 3, 4]
    for r in reference:
        assert {"step", "loss", "tokens_per_s", "mfu", "mem_gib", "lr", "layout"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["mem_gib"] > 0
    assert reference[0]["layout"] == "pp=1 dp=1 tp=1"
    assert abs(reference[0]["loss"] - np.log(256)) < 0.1  # random init: about log(vocab)
    assert reference[0]["lr"] == pytest.approx(3e-3) and reference[-1]["lr"] == pytest.approx(3e-4)


@pytest.mark.parametrize("layout", [
    pytest.param(["--nproc", "2", "--dp", "2"], id="dp2"),
    pytest.param(["--nproc", "2", "--dp", "2", "--no-reshard"], id="dp2-noreshard"),
    pytest.param(["--nproc", "2", "--tp", "2"], id="tp2"),
    pytest.param(["--nproc", "2", "--pp", "2"], id="pp2"),
    pytest.param(["--nproc", "4", "--dp", "2", "--tp", "2"], id="dp2-tp2"),
])
def test_layouts_give_the_losses_of_one_process(layout, reference, work):
    name = "-".join(layout[2:]).replace("--", "")
    records = _run(work, name, *layout)
    _assert_same_losses(records, reference)


def test_gradient_accumulation_and_ddp_give_the_same_losses(reference, work):
    _assert_same_losses(_run(work, "accumulate", "--microbatches", "2"), reference)
    _assert_same_losses(_run(work, "ddp", "--nproc", "2", "--dp", "2", "--dp-mode", "ddp", "--microbatches", "2"),
                        reference)


def test_resume_is_exact(reference, work):
    ckpt = work / "ckpt-resume"
    first = _run(work, "stop", "--checkpoint-dir", str(ckpt), "--stop-after", "2")
    assert [r["step"] for r in first] == [1, 2]
    assert trainer.latest_checkpoint(str(ckpt)).name == "step-00000002"
    second = _run(work, "resume", "--checkpoint-dir", str(ckpt), "--resume")
    assert [r["step"] for r in second] == [3, 4]
    assert [r["loss"] for r in first + second] == [r["loss"] for r in reference]  # bitwise: same process layout
    assert trainer.main(COMMON + ["--checkpoint-dir", str(ckpt), "--resume"]) == 0  # saved at the end: complete


def test_resume_under_another_layout_is_exact(reference, work):
    ckpt = work / "ckpt-relayout"
    _run(work, "stop-dp2", "--checkpoint-dir", str(ckpt), "--stop-after", "2", "--nproc", "2", "--dp", "2")
    resumed = _run(work, "resume-tp2", "--checkpoint-dir", str(ckpt), "--resume", "--nproc", "2", "--tp", "2",
                   "--export-hf", str(work / "hf-tp2"))
    assert [r["step"] for r in resumed] == [3, 4]
    _assert_same_losses(resumed, [r for r in reference if r["step"] > 2])


def test_exports_of_different_layouts_give_the_same_logits(reference, work):
    from transformers import LlamaForCausalLM

    _assert_same_losses(_run(work, "export-single", "--export-hf", str(work / "hf-single")), reference)
    if not (work / "hf-tp2").exists():  # made by the resume test; standalone, train it here
        _run(work, "export-tp2", "--nproc", "2", "--tp", "2", "--export-hf", str(work / "hf-tp2"))
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    logits = []
    for name in ("hf-single", "hf-tp2"):
        model = LlamaForCausalLM.from_pretrained(str(work / name)).eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert not torch.equal(logits[0], LlamaForCausalLM(model.config).eval()(input_ids=ids).logits)


def test_a_pipeline_run_exports_a_model_transformers_loads(reference, work):
    """--export-hf under --pp: the stages hold no HF config of their own; the export still writes the whole model."""
    from transformers import AutoModelForCausalLM

    _assert_same_losses(_run(work, "export-pp2", "--nproc", "2", "--pp", "2", "--pp-schedule", "GPipe",
                             "--microbatches", "2", "--export-hf", str(work / "hf-pp2")), reference)
    if not (work / "hf-single").exists():
        _run(work, "export-single", "--export-hf", str(work / "hf-single"))
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(str(work / name)).eval()(input_ids=ids).logits
                  for name in ("hf-single", "hf-pp2")]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert json.loads((work / "hf-pp2" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_token_files_npy_and_bin(work):
    tokens = np.random.default_rng(0).integers(0, 256, size=5000).astype(np.uint16)
    np.save(work / "tokens.npy", tokens.astype(np.int32))
    tokens.tofile(work / "tokens.bin")  # raw uint16: the vocabulary is < 65536
    from_npy = _run(work, "npy", "--data", str(work / "tokens.npy"))
    from_bin = _run(work, "bin", "--data", str(work / "tokens.bin"))
    assert [r["loss"] for r in from_npy] == [r["loss"] for r in from_bin]
    batches = trainer.TokenBatches(str(work / "tokens.bin"), 256, 5, 4, 32)
    assert torch.equal(batches.batch(3), batches.batch(3)) and not torch.equal(batches.batch(3), batches.batch(4))
    row = batches.batch(1)[0].numpy()
    starts = [i for i in range(len(tokens) - 32) if (tokens[i:i + 33] == row).all()]
    assert starts, "each row is a window of the file"


def test_fine_tune_from_a_pretrained_checkpoint_under_another_layout(work):
    """--init-from: the first step's loss is the pretrained model's (as transformers loads it), then it falls."""
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(1)
    # an easily learned stream: a cycle through 32 of the 256 tokens in a fixed random order
    cycle = rng.permutation(256)[:32]
    np.save(work / "ft.npy", np.tile(cycle, 200).astype(np.int32))
    data = ["--data", str(work / "ft.npy")]
    assert trainer.main(COMMON[:4] + ["--steps", "2", "--device", "cpu", *data, "--export-hf",
                                      str(work / "pretrained")]) == 0
    metrics = work / "finetune.jsonl"
    # no --model / --config: both come from the checkpoint's config.json
    code = trainer.main(["--init-from", str(work / "pretrained"), *data, "--nproc", "2", "--tp", "2", "--steps", "8",
                         "--global-batch", "4", "--seq", "32", "--lr", "1e-2", "--lr-schedule", "constant",
                         "--device", "cpu", "--seed", "9", "--metrics", str(metrics)])
    assert code == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    hf = AutoModelForCausalLM.from_pretrained(work / "pretrained")
    tokens = trainer.TokenBatches(str(work / "ft.npy"), 256, 9, 4, 32).batch(1)
    with torch.no_grad():
        logits = hf(input_ids=tokens[:, :-1]).logits
    start = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
    assert records[0]["loss"] == pytest.approx(start, rel=1e-5)
    assert records[-1]["loss"] < 0.9 * start


def test_init_from_must_be_a_checkpoint(tmp_path, capsys):
    assert trainer.main(["--init-from", str(tmp_path / "nowhere"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--init-from" in err and "no such directory" in err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4,
                                                      "vocab_size": 64, "n_positions": 64}))
    assert trainer.main(["--init-from", str(tmp_path), "--device", "cpu", "--seq", "16"]) == 2
    assert "holds no .safetensors file" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("flags,message", [
    (["--nproc", "3", "--dp", "2"], "--dp 2 x --tp 1 x --pp 1 = 2 ranks, but the run has 3"),
    (["--nproc", "3", "--tp", "3"], "--tp 3 must divide the model's attention heads (4); valid --tp values for "
                                    "this model: 1, 2, 4"),
    (["--nproc", "2", "--dp", "2", "--global-batch", "3"], "--global-batch 3 must be divisible by --dp x "
                                                            "--microbatches = 2 x 1 = 2"),
    (["--nproc", "2", "--pp", "2", "--microbatches", "3"], "--global-batch 4 must be divisible by --dp x "
                                                           "--microbatches = 1 x 3 = 3"),
    (["--seq", "200"], "--seq 200 exceeds the model's 128 positions"),
    (["--model", "bert"], "--model bert: the presets 'tiny' and '1b' exist for llama, gpt2; for a 'bert' model give "
                          "--config the path of its config.json (or its directory)"),
    (["--config", "no/such/config.json"], "--config 'no/such/config.json' is neither 'tiny', '1b' nor"),
    (["--data", "no_such_tokens.bin"], "--data 'no_such_tokens.bin': no such file"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--async-save"], "--async-save writes the checkpoints in the background: it needs --checkpoint-dir"),
    (["--sp"], "--sp (sequence parallelism) splits the sequence over the tp ranks: it needs --tp >= 2"),
    (["--reduce-dtype", "bf16", "--nproc", "2", "--dp", "2"], "--reduce-dtype bf16 sums bf16 gradients over the dp "
     "ranks: it needs --dtype bf16 and --dp >= 2, got --dtype fp32 --dp 2"),
    (["--no-reshard", "--nproc", "2", "--dp", "2", "--dp-mode", "ddp"], "--no-reshard keeps FSDP2's gathered "
     "weights: it needs --dp-mode fsdp and --dp >= 2, got --dp-mode ddp --dp 2"),
    (["--stop-after", "9"], "--stop-after must be a step of the run, 1..4"),
    (["--stop-after", "2"], "--stop-after 2 stops the run to continue it later with --resume, which needs "
                            "--checkpoint-dir"),
    (["--optimizer", "lamb"], "--optimizer: unknown optimizer 'lamb'"),
    (["--pp-schedule", "Zigzag"], "--pp-schedule: unknown schedule 'Zigzag'"),
    (["--timeout", "-1"], "--timeout must be a positive number of seconds, got -1.0"),
    (["--stages-per-rank", "0"], "--stages-per-rank must be at least 1, got 0"),
    (["--metrics", "no_such_dir/metrics.jsonl"], "--metrics: the directory 'no_such_dir' of "
                                                 "'no_such_dir/metrics.jsonl' does not exist"),
    (["--metrics", "."], "--metrics: '.' is a directory: give the path of a file to write"),
    (["--optimize", "--nproc", "2", "--pp", "2"], "--optimize rewrites the whole model's norms, head and loss, which "
                                                   "pipeline stages split: it works on pp=1 layouts, got --pp 2"),
])
def test_bad_flags_fail_with_a_clear_message(flags, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert trainer.main(COMMON + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("schedlang train: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_outputs_that_cannot_be_written_fail_before_training(tmp_path, capsys):
    a_file = tmp_path / "model.bin"
    a_file.write_text("")
    metrics = tmp_path / "metrics.jsonl"
    assert trainer.main(COMMON + ["--metrics", str(metrics), "--export-hf", str(a_file)]) == 2
    err = capsys.readouterr().err
    assert f"--export-hf: '{a_file}' is an existing file: give a directory" in err and "step 1" not in err, err
    assert not metrics.exists()  # probed, and nothing left behind
    assert trainer.main(COMMON + ["--export-hf", str(a_file / "hf")]) == 2
    assert "is a file, so the directory" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "holds a JSON list, not an object; pass a transformers config.json"),
    (json.dumps({"foo": 1}), "unknown key(s) foo for a LlamaConfig: valid keys are _name_or_path, architectures"),
    (json.dumps({"hidden_size": 64, "num_attention_heads": 5, "num_hidden_layers": 1, "intermediate_size": 32,
                 "vocab_size": 100}),
     "transformers refuses it as a LlamaConfig: Class validation error for validator 'validate_architecture': "
     "ValueError: The hidden size (64) is not a multiple of the number of attention heads (5); fix the config"),
], ids=["list", "unknown key", "heads"])
def test_bad_config_files_fail_with_a_clear_message(tmp_path, capsys, content, message):
    config = tmp_path / "config.json"
    config.write_text(content)
    assert trainer.main(COMMON + ["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"schedlang train: error: --config {config}: ") and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_gpt2_heads_must_divide_the_hidden_size(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_head": 5, "n_layer": 1,
                                                      "vocab_size": 64, "n_positions": 64}))
    assert trainer.main(COMMON + ["--model", "gpt2", "--config", str(tmp_path), "--seq", "16"]) == 2
    assert "the hidden size 64 must be divisible by the number of attention heads (5" in capsys.readouterr().err


def test_published_configs_with_keys_transformers_converts_or_keeps_are_accepted(tmp_path):
    """TinyLlama's and GPT-2's config.json as published: rope_theta and torch_dtype (converted on load), n_ctx and
    task_specific_params (carried along) are not typos."""
    from schedlang.train import model_config

    llama = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
             "intermediate_size": 128, "vocab_size": 256, "rope_theta": 10000.0, "rope_scaling": None,
             "torch_dtype": "bfloat16", "transformers_version": "4.35.0", "architectures": ["LlamaForCausalLM"]}
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 1, "vocab_size": 256, "n_ctx": 128,
            "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}}}
    for name, raw in (("llama", llama), ("gpt2", gpt2)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(raw))
        assert model_config(name, str(path)).vocab_size == 256


def test_kv_heads_must_divide_tp(tmp_path, capsys):
    cfg = llama_config(attn=None, num_key_value_heads=1)
    cfg.save_pretrained(tmp_path)
    assert trainer.main(COMMON + ["--config", str(tmp_path), "--nproc", "2", "--tp", "2"]) == 2
    assert ("--tp 2: the model has 1 key/value head(s), fewer than the 2 tensor-parallel ranks; each rank needs "
            "whole key/value heads (they are not replicated); valid --tp values for this model: 1") \
        in capsys.readouterr().err
    assert trainer.main(COMMON + ["--config", str(tmp_path / "config.json"), "--model", "gpt2"]) == 2
    assert "describes a 'llama' model but --model is 'gpt2'" in capsys.readouterr().err


def test_resume_refuses_a_checkpoint_of_another_model_and_a_new_run_refuses_a_used_directory(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert trainer.main(COMMON + ["--checkpoint-dir", str(ckpt), "--stop-after", "1"]) == 0
    capsys.readouterr()
    narrow = tmp_path / "narrow.json"
    narrow.write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 256,
                                  "max_position_embeddings": 128}))
    flags = COMMON + ["--checkpoint-dir", str(ckpt), "--resume", "--config", str(narrow)]
    assert trainer.main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "holds a llama layers 4, hidden 64" in err and "builds a llama layers 2, hidden 32" in err
    assert f"--config {narrow}" in err and "saved with --model llama --config tiny" in err
    # without --resume, a run would put its checkpoints beside these and a later --resume take the newest of either
    assert trainer.main(COMMON + ["--checkpoint-dir", str(ckpt)]) == 2
    assert "already holds checkpoints of a run (the latest is step-00000001); pass --resume" in capsys.readouterr().err


def test_a_damaged_trainer_state_is_skipped_and_named(tmp_path, caplog):
    """A checkpoint whose trainer state was cut short is not resumed from: the warning names its step and why; with
    no other checkpoint the run starts fresh (the same command line serves a first start and every restart)."""
    ckpt = tmp_path / "ckpt"
    assert trainer.main(COMMON + ["--checkpoint-dir", str(ckpt), "--stop-after", "1"]) == 0
    state = ckpt / "step-00000001" / "trainer.json"
    state.write_text('{"step": 1, "se')  # cut short
    records = _run(tmp_path, "after-damage", "--checkpoint-dir", str(ckpt), "--resume")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    warnings = [r.getMessage() for r in caplog.records if r.name == "schedlang.train" and r.levelname == "WARNING"]
    assert any(w.startswith(f"--resume: skipping the checkpoint of step 1 ({ckpt / 'step-00000001'}): ") and
               "trainer.json has 15 bytes, the manifest says" in w for w in warnings), warnings
    assert f"--resume: no complete checkpoint in {ckpt}: starting from step 1" in warnings


def test_a_failure_message_that_names_ranks_reads_whole():
    """A checkpoint read that fails on each rank says so per rank inside one message: the summary keeps it whole."""
    from schedlang.errors import DistributedError
    from schedlang.train.command import _failure_summary

    message = ("load_checkpoint: cannot read 'ckpt/step-00000006': rank 0: RuntimeError: bad zip; rank 1: "
               "RuntimeError: bad zip; check that every file of the checkpoint was written and copied whole")
    tb = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
          f"schedlang.errors.CheckpointError: {message}\n")
    error = DistributedError("run_distributed: distributed run of _rank_main on 2 ranks (gloo) failed:\n"
                             "rank 0 failed first (CheckpointError)\n"
                             f"rank 0 failed:\n{tb}rank 1 failed:\n{tb}"
                             "rank(s) [2] did not finish within 60 s (stopped 5 s after rank 0 failed)")
    assert _failure_summary(error) == message


def test_a_failing_rank_fails_the_run_without_hanging(tmp_path, capsys):
    bad = tmp_path / "tokens.npy"
    np.save(bad, np.full(100, 300, dtype=np.int64))  # token ids beyond the vocabulary: found when reading a batch
    assert trainer.main(COMMON + ["--nproc", "2", "--dp", "2", "--data", str(bad)]) != 0
    assert "token id 300" in capsys.readouterr().err


def test_cli_train_subcommand(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--dp", "--tp", "--pp", "--sp", "--global-batch", "--checkpoint-dir", "--resume", "--export-hf",
                 "--metrics", "--pp-schedule", "--microbatches", "--optimizer", "--stop-after"):
        assert flag in out
    result = subprocess.run([sys.executable, "-m", "schedlang.train", "--nproc", "2", "--tp", "4", "--device", "cpu"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--dp 1 x --tp 4 x --pp 1 = 4 ranks, but the run has 2" in result.stderr


def test_gpt2_with_sequence_parallelism_trains_like_one_process(work):
    gpt2 = ["--model", "gpt2"]
    _assert_same_losses(_run(work, "gpt2-sp", *gpt2, "--nproc", "2", "--tp", "2", "--sp"), _run(work, "gpt2", *gpt2))


def test_interleaved_pipeline_with_a_tied_weight_trains_like_one_process(work):
    # GPT-2's LM head is its token embedding: stages 0 and 3 (on pp ranks 0 and 1) both hold it
    gpt2 = ["--model", "gpt2"]
    records = _run(work, "gpt2-interleaved", *gpt2, "--nproc", "2", "--pp", "2", "--pp-schedule", "Interleaved1F1B")
    assert records[0]["layout"] == "pp=2 dp=1 tp=1 (Interleaved1F1B x4 mb)"
    _assert_same_losses(records, _run(work, "gpt2-single", *gpt2))


# ------------------------------------------------------------------------------------------- --optimize
@pytest.mark.parametrize("layout", [
    pytest.param([], id="single"),
    pytest.param(["--microbatches", "2", "--activation-checkpoint"], id="accumulate-checkpoint"),
    pytest.param(["--nproc", "2", "--dp", "2"], id="fsdp2"),
    pytest.param(["--nproc", "2", "--dp", "2", "--dp-mode", "ddp"], id="ddp2"),
    pytest.param(["--nproc", "2", "--tp", "2"], id="tp2"),
])
def test_optimize_trains_like_the_plain_model(layout, reference, work, caplog):
    """optimize_model's fused norms and fused head + loss (the labels passed aligned, so no token is lost to a
    shift) give the plain model's losses and gradient norms, under every pp=1 layout."""
    caplog.set_level("INFO", logger="schedlang.train")
    name = "optimize-" + ("-".join(layout).replace("--", "") or "single")
    _assert_same_losses(_run(work, name, "--optimize", *layout), reference)
    if "--nproc" not in layout:  # the run was in this process: its log says what optimize_model did
        said = " ".join(r.getMessage() for r in caplog.records if "optimize_model" in r.getMessage())
        assert "x LlamaRMSNorm -> FusedRMSNorm" in said and "loss: lm_head -> fused linear + cross entropy" \
            in said, said


def test_optimize_trains_gpt2_like_the_plain_model(work):
    gpt2 = ["--model", "gpt2"]
    _assert_same_losses(_run(work, "gpt2-optimize", *gpt2, "--optimize"), _run(work, "gpt2-plain", *gpt2))


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32), ("cpu", torch.bfloat16),
                                           pytest.param("cuda", torch.float32, marks=pytest.mark.gpu),
                                           pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("clip", [0.5, 1e6, 0.0])
def test_gradient_clipping_matches_torch(clip, device, dtype):
    """The trainer's clipping (one multi-tensor norm, then one multi-tensor scale) is torch's clip_grad_norm_,
    for fp32 gradients and for the bf16 gradients of bf16 weights (the norm taken in fp32 on both sides)."""
    import argparse

    from schedlang.train.run import _Run

    torch.manual_seed(0)

    def make():
        return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.LayerNorm(7),
                                   torch.nn.Linear(7, 3, bias=False)).to(device=device, dtype=dtype)

    model, twin = make(), make()
    twin.load_state_dict(model.state_dict())
    for p, q in zip(model.parameters(), twin.parameters()):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    model[1].bias.grad = None  # a parameter without a gradient is left out
    twin[1].bias.grad = None
    run = _Run(argparse.Namespace(grad_clip=clip, pp=1), rank=0, world=1, device=torch.device(device))
    run.model, run.grad_weight = model, {}
    norm = float(run._clip())
    reference_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(q.grad, dtype=torch.float32) for q in twin.parameters()
                     if q.grad is not None]))
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), clip if clip else float("inf"))
    assert norm == pytest.approx(float(reference_norm), rel=1e-6)
    if dtype == torch.float32:
        assert norm == pytest.approx(float(expected), rel=1e-6)
    tolerance = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    for p, q in zip(model.parameters(), twin.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **tolerance)


def test_progress_shows_mfu_only_on_a_gpu(tmp_path, capsys):
    """MFU divides by a GPU's dense bf16 peak: on a CPU the progress lines leave it out rather than print 0.00%."""
    from schedlang.train.loop import _mfu_text

    _run(tmp_path, "progress", "--steps", "2", "--log-every", "1")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(("step ", "done: "))]
    assert len(lines) == 3 and all("tok/s" in line and "mfu" not in line for line in lines), lines
    assert _mfu_text(0.4125, torch.device("cuda"), ", ") == ", mfu 41.25%"
    assert _mfu_text(0.4125, torch.device("cpu"), ", ") == ""


def _data_parallel_policies(rank, world):
    """On each rank: the FSDP2 settings the trainer gives its layers for --no-reshard --reduce-dtype bf16."""
    from torch.distributed.fsdp import FSDPModule

    from schedlang.train.flags import build_parser, validate
    from schedlang.train.run import _Run

    ns = build_parser("schedlang train").parse_args(
        COMMON + ["--dp", "2", "--dtype", "bf16", "--reduce-dtype", "bf16", "--no-reshard", "--device", "cpu"])
    validate(ns, world)
    run = _Run(ns, rank, world, torch.device("cpu"))
    run.make_mesh()
    run.build()
    layers = [m for name, m in run.model.named_modules() if isinstance(m, FSDPModule) and name.count(".") == 2]
    states = [m._get_fsdp_state() for m in layers]
    return (len(layers) == run.dims.layers, {(s._mp_policy.param_dtype, s._mp_policy.reduce_dtype) for s in states},
            {s._fsdp_param_group.post_forward_mesh_info is None for s in states}, run.layout())


def test_no_reshard_and_bf16_reduction_reach_fsdp2():
    """--no-reshard keeps each layer's gathered weights to its backward; --reduce-dtype bf16 sums in bf16."""
    from tests.helpers.distributed import run_distributed

    for every_layer, policies, kept, layout in run_distributed(_data_parallel_policies, world_size=2, timeout=300):
        assert every_layer  # every decoder layer is an FSDP2 unit of its own
        assert policies == {(torch.bfloat16, torch.bfloat16)}
        assert kept == {True}  # no post-forward resharding
        assert layout == "pp=1 dp=2 tp=1 (fsdp no-reshard bf16-reduce)"


def _gradient_all_reduces_per_step(rank, world, microbatches):
    """On each rank: the all-reduces of gradient buffers (more than one element: not the loss or the gradient
    norm) in one DDP step of ``microbatches`` accumulation steps, and the number of data-parallel units."""
    from unittest import mock

    import torch.distributed as dist

    from schedlang.distributed.data_parallel import set_gradient_sync
    from schedlang.train.flags import build_parser, validate
    from schedlang.train.run import _Run

    ns = build_parser("schedlang train").parse_args(
        COMMON + ["--dp", "2", "--dp-mode", "ddp", "--microbatches", str(microbatches), "--global-batch", "8"])
    validate(ns, world)
    run = _Run(ns, rank, world, torch.device("cpu"))
    run.make_mesh()
    run.build()
    sizes = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        if tensor.numel() > 1:
            sizes.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    tokens = torch.randint(0, run.dims.vocab, (ns.global_batch, ns.seq + 1), generator=torch.Generator().manual_seed(0))
    with mock.patch.object(dist, "all_reduce", counting):
        float(run.step(1, tokens)["loss"])
    units = set_gradient_sync(run.model, True)
    return sizes, units, sum(p.numel() for p in run.model.parameters())


def _packed_sequence_checks_in_a_pipelined_step(rank, world):
    """On each rank: how often transformers' packed-sequence check ran (a host sync each) in one pipelined step,
    and the step's loss on the last stage."""
    from unittest import mock

    from transformers import masking_utils

    from schedlang.train.flags import build_parser, validate
    from schedlang.train.run import _Run

    ns = build_parser("schedlang train").parse_args(COMMON + ["--pp", "2", "--microbatches", "2"])
    validate(ns, world)
    run = _Run(ns, rank, world, torch.device("cpu"))
    run.make_mesh()
    run.build()
    tokens = torch.randint(0, run.dims.vocab, (ns.global_batch, ns.seq + 1), generator=torch.Generator().manual_seed(0))
    checked = []
    original = getattr(masking_utils.find_packed_sequence_indices, "__wrapped__",
                       masking_utils.find_packed_sequence_indices)

    def counting(position_ids, *args, **kwargs):
        checked.append(tuple(position_ids.shape))
        return original(position_ids, *args, **kwargs)

    from schedlang.models import packed_sequences

    # transformers' own check counted wherever it is reached from: through schedlang's wrapper or directly
    direct = getattr(masking_utils.find_packed_sequence_indices, "_schedlang_wrapped", False)
    with mock.patch.object(packed_sequences, "_ORIGINAL", [counting]), \
            mock.patch.object(masking_utils, "find_packed_sequence_indices",
                              masking_utils.find_packed_sequence_indices if direct else counting):
        loss = float(run.step(1, tokens)["loss"])
    return checked, loss


def test_a_pipelined_run_asks_no_packed_sequence_check():
    """The first stage makes the positions (no --cp): each microbatch's check of them, a host sync, is answered
    without it, and the step is the one the other layouts train (its loss is one process's, in
    test_layouts_give_the_losses_of_one_process[pp2])."""
    from tests.helpers.distributed import run_distributed

    results = run_distributed(_packed_sequence_checks_in_a_pipelined_step, world_size=2, timeout=300)
    assert [checked for checked, _ in results] == [[], []]
    assert all(math.isfinite(loss) for _, loss in results)


@pytest.mark.parametrize("microbatches", [1, 4])
def test_ddp_accumulation_all_reduces_the_gradients_once_per_step(microbatches):
    """DDP with --microbatches m sums the gradients over the replicas after the last microbatch only: one
    all-reduce per unit and step, of the whole gradient, whatever m (the per-microbatch ones are skipped)."""
    from tests.helpers.distributed import run_distributed

    for sizes, units, params in run_distributed(_gradient_all_reduces_per_step, world_size=2, timeout=300,
                                                args=(microbatches,)):
        assert units == 1  # the trainer replicates the root
        assert sizes == [params]

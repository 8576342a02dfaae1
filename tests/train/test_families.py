"""The trainer on HF families other than LLaMA and GPT-2, each from a tiny config.json: Qwen3 and Gemma
(tied embeddings), Mistral, Phi-3 (fused q|k|v and gate|up projections) and OPT (biases, learned
positions). Under data, tensor and pipeline parallelism each reports the losses and gradient norms of
one process, for 3 fp32 steps. A family or layout that cannot work is refused before any weight is
allocated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from schedlang import train as trainer

STEPS = 3
_SMALL = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64, vocab_size=128,
              max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "qwen3": dict(_SMALL, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True),
    "mistral": dict(_SMALL, num_key_value_heads=2, sliding_window=None),
    "gemma": dict(_SMALL, num_key_value_heads=2, head_dim=8),  # tied embeddings, (1 + weight) norms
    "phi3": dict(_SMALL, num_key_value_heads=2),
    "opt": dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, ffn_dim=64, vocab_size=128,
                max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


def write_config(directory: Path, family: str, **changes) -> Path:
    from transformers import AutoConfig

    directory.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(family, **{**FAMILIES[family], **changes}).save_pretrained(directory)
    return directory


def _run(tmp: Path, config: Path, name: str, *flags: str):
    metrics = tmp / f"{name}.jsonl"
    args = ["--config", str(config), "--steps", str(STEPS), "--global-batch", "4", "--seq", "16", "--lr", "3e-3",
            "--device", "cpu", "--dtype", "fp32", "--seed", "3", "--metrics", str(metrics), *flags]
    assert trainer.main(args) == 0, args
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _assert_same(records, reference):
    assert [r["step"] for r in records] == [r["step"] for r in reference] == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records]), torch.tensor([r["loss"] for r in reference]),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in records]),
                               torch.tensor([r["grad_norm"] for r in reference]), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


#: the layouts every family trains under: tensor parallelism on 2 ranks; data parallelism (FSDP2) over pipeline
#: stages on 4 (one launch covers both); the tied families also FSDP2 alone, where one unit holds both ends
LAYOUTS = [["--nproc", "2", "--tp", "2"], ["--nproc", "4", "--dp", "2", "--pp", "2", "--pp-schedule", "GPipe"]]
TIED_ALONE = ["--nproc", "2", "--dp", "2"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_trains_under_every_parallelism_like_one_process(family, work):
    config = write_config(work / family, family)
    reference = _run(work, config, f"{family}-single")
    assert reference[0]["loss"] == pytest.approx(torch.log(torch.tensor(128.0)).item(), abs=0.3)
    assert reference[-1]["loss"] < reference[0]["loss"]
    tied = family in ("gemma", "qwen3", "opt")
    # OPT's decoder builds its position mask with torch.ones(batch, seq) on traced sizes: its stages are cut too
    layouts = LAYOUTS + ([TIED_ALONE] if family in ("gemma", "opt") else [])
    for layout in layouts:
        records = _run(work, config, f"{family}-{'-'.join(layout[1:]).replace('--', '')}", *layout)
        _assert_same(records, reference)
        assert records[0]["layout"].startswith(f"pp={layout[layout.index('--pp') + 1] if '--pp' in layout else 1}")
    assert tied == (json.loads((config / "config.json").read_text()).get("tie_word_embeddings", True))


def test_fine_tuning_a_tied_family_from_its_export_under_tensor_parallelism(work):
    """--init-from a Qwen3 checkpoint (tied embeddings) written by --export-hf: the config and family come from its
    config.json, and the first step's loss under --tp 2 is the loss transformers computes with those weights."""
    from transformers import AutoModelForCausalLM

    config = write_config(work / "qwen3-ft", "qwen3")
    _run(work, config, "qwen3-pretrain", "--export-hf", str(work / "qwen3-pretrained"))
    metrics = work / "qwen3-ft.jsonl"
    assert trainer.main(["--init-from", str(work / "qwen3-pretrained"), "--nproc", "2", "--tp", "2", "--steps", "2",
                         "--global-batch", "4", "--seq", "16", "--device", "cpu", "--seed", "8", "--metrics",
                         str(metrics)]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    hf = AutoModelForCausalLM.from_pretrained(work / "qwen3-pretrained").eval()
    assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    tokens = trainer.TokenBatches("synthetic", 128, 8, 4, 16).batch(1)
    with torch.no_grad():
        logits = hf(input_ids=tokens[:, :-1]).logits
    expected = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
    assert records[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert records[0]["layout"] == "pp=1 dp=1 tp=2"


def test_a_family_or_layout_that_cannot_work_is_refused_before_any_weight(work, capsys, monkeypatch):
    import schedlang.distributed.launch as launch

    monkeypatch.setattr(launch, "run_distributed", lambda *a, **k: pytest.fail("ranks were started"))
    few_kv = write_config(work / "mistral-kv1", "mistral", num_key_value_heads=1)
    assert trainer.main(["--config", str(few_kv), "--nproc", "2", "--tp", "2", "--device", "cpu", "--seq", "16"]) == 2
    assert ("--tp 2: the model has 1 key/value head(s), fewer than the 2 tensor-parallel ranks"
            in capsys.readouterr().err)
    bert = work / "bert"
    bert.mkdir(exist_ok=True)
    (bert / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 32}))
    assert trainer.main(["--config", str(bert), "--device", "cpu"]) == 2
    assert "'t5' models have no causal-LM class in transformers (AutoModelForCausalLM)" in capsys.readouterr().err
    unknown = work / "unknown"
    unknown.mkdir(exist_ok=True)
    (unknown / "config.json").write_text(json.dumps({"model_type": "no-such-family"}))
    assert trainer.main(["--config", str(unknown), "--device", "cpu"]) == 2
    assert "model_type 'no-such-family' is not a model family this transformers" in capsys.readouterr().err

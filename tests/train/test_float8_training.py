"""--float8 in the trainer: the decoder layers' Linears train through torchao's float8 (tensorwise scales), on
the CPU too (emulated); the losses follow those of the fp32 run within float8's rounding. Too-small models are
refused before anything is built."""

import json

import pytest

from schedlang import train as trainer

pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'schedlang[fp8]')")


def _config(tmp_path, hidden):
    path = tmp_path / f"llama-{hidden}.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": hidden, "intermediate_size": 2 * hidden,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                                "vocab_size": 256, "max_position_embeddings": 64}))
    return str(path)


def test_float8_training_follows_the_fp32_losses(tmp_path):
    flags = ["--config", _config(tmp_path, 128), "--steps", "3", "--global-batch", "3", "--seq", "24", "--device",
             "cpu", "--seed", "2", "--lr", "3e-3"]
    losses = {}
    for name, extra in (("fp32", []), ("float8", ["--float8"])):
        out = tmp_path / f"{name}.jsonl"
        assert trainer.main(flags + extra + ["--metrics", str(out)]) == 0
        losses[name] = [json.loads(line)["loss"] for line in out.read_text().splitlines()]
    assert losses["float8"] == pytest.approx(losses["fp32"], rel=3e-2)
    # float8 rounding changed something: the Linears were converted
    assert max(abs(a / b - 1) for a, b in zip(losses["float8"], losses["fp32"])) > 1e-5


def test_float8_refuses_a_model_too_small_for_its_gemms(tmp_path, capsys):
    assert trainer.main(["--config", _config(tmp_path, 64), "--device", "cpu", "--steps", "1", "--float8"]) == 2
    assert ("--float8 trains the layers' Linears in float8, whose GEMMs need both sides a multiple of 16 and at "
            "least 128 (smaller ones cost more in casts than they save): this model's hidden size is 64; drop "
            "--float8") in capsys.readouterr().err

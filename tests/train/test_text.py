"""Text data: .jsonl / .txt files or a directory of them, read with a tokenizer made here (a WordLevel
tokenizer trained on the test's own corpus), tokenized once into a token cache beside the data and packed
with EOS between documents; held-out evaluation; every bad input named by file and line, nothing written."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from schedlang import train as trainer

WORDS = ["the", "cat", "dog", "sat", "ran", "on", "a", "mat", "log", "and", "then", "slept", "fast", "slow"]


def corpus(n: int, seed: int):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n)]


def make_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus(50, 0), trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    make_tokenizer(root / "tok")
    (root / "train.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n"
                                              for i, t in enumerate(corpus(300, 1))))
    (root / "heldout.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(80, 2)))
    return root


COMMON = ["--config", "tiny", "--global-batch", "4", "--seq", "32", "--lr", "3e-3", "--device", "cpu",
          "--dtype", "fp32", "--seed", "4"]


def _run(work: Path, name: str, *flags: str, data: str = "train.jsonl"):
    metrics = work / f"{name}.jsonl"
    args = COMMON + ["--data", str(work / data), "--tokenizer", str(work / "tok"), "--metrics", str(metrics),
                     *flags]
    assert trainer.main(args) == 0, args
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_text_is_tokenized_once_packed_with_eos_and_trains(work):
    from transformers import AutoTokenizer

    records = _run(work, "text", "--steps", "4")
    caches = sorted(work.glob("train.jsonl.tokens-*.bin"))
    assert len(caches) == 1 and caches[0].with_suffix(".json").is_file()
    meta = json.loads(caches[0].with_suffix(".json").read_text())
    tok = AutoTokenizer.from_pretrained(work / "tok")
    expected = []
    for line in (work / "train.jsonl").read_text().splitlines():
        expected += tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    cached = np.fromfile(caches[0], dtype=meta["dtype"])
    assert meta["dtype"] == "uint16" and meta["documents"] == 300 and cached.tolist() == expected
    assert records[-1]["loss"] < records[0]["loss"]
    stamp = caches[0].stat().st_mtime_ns
    again = _run(work, "text-again", "--steps", "4")  # the same text and tokenizer: the cache is reused
    assert caches[0].stat().st_mtime_ns == stamp
    assert [r["loss"] for r in again] == [r["loss"] for r in records]  # batches are a function of (seed, step)


def test_a_changed_text_gets_a_new_cache(work, tmp_path):
    data = tmp_path / "docs"
    data.mkdir()
    (data / "a.txt").write_text(" ".join(corpus(40, 5)))
    (data / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(40, 6)))
    flags = COMMON + ["--tokenizer", str(work / "tok"), "--steps", "1", "--data", str(data)]
    assert trainer.main(flags) == 0
    first = sorted(tmp_path.glob("docs.tokens-*.bin"))
    assert len(first) == 1 and json.loads(first[0].with_suffix(".json").read_text())["documents"] == 41
    (data / "a.txt").write_text(" ".join(corpus(40, 7)))
    assert trainer.main(flags) == 0
    assert len(sorted(tmp_path.glob("docs.tokens-*.bin"))) == 2


def test_evaluation_adds_eval_loss_and_is_the_same_under_data_parallelism(work):
    flags = ["--steps", "4", "--eval-data", str(work / "heldout.jsonl"), "--eval-every", "2", "--eval-batches", "2"]
    single = _run(work, "eval-single", *flags)
    assert [r["step"] for r in single if "eval_loss" in r] == [2, 4]
    dp = _run(work, "eval-dp2", *flags, "--nproc", "2", "--dp", "2")
    torch.testing.assert_close(torch.tensor([r.get("eval_loss", 0.0) for r in dp]),
                               torch.tensor([r.get("eval_loss", 0.0) for r in single]), rtol=1e-5, atol=1e-5)
    # the held-out loss is the mean token cross entropy of the model on the first windows of the held-out text
    assert single[1]["eval_loss"] > 0 and single[3]["eval_loss"] < single[1]["eval_loss"] + 1.0


@pytest.mark.parametrize("content, message", [
    ("", "train.jsonl: empty file (no JSON line with a 'text' field)"),
    ('{"text": "the cat"}\n{"body": "sat"}\n', "train.jsonl:2: no 'text' field (found body); each line must be an "
                                              "object with the document in 'text'"),
    ('{"text": "the cat"}\n\n{"text": "sat",\n', "train.jsonl:3: invalid JSON (Expecting property name enclosed in "
                                                 "double quotes at column 16)"),
    ('{"text": 7}\n', "train.jsonl:1: 'text' is a int, not a string"),
], ids=["empty", "no text", "invalid json", "not a string"])
def test_bad_text_is_named_by_file_and_line_and_nothing_is_written(work, tmp_path, capsys, content, message):
    (tmp_path / "train.jsonl").write_text(content)
    before = set(tmp_path.iterdir())
    code = trainer.main(COMMON + ["--data", str(tmp_path / "train.jsonl"), "--tokenizer", str(work / "tok")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"schedlang train: error: --data {tmp_path}/") and message in err, err
    assert set(tmp_path.iterdir()) == before  # no cache, no partial file


def test_a_tokenizer_larger_than_the_model_and_missing_ones_are_refused(work, tmp_path, capsys):
    (tmp_path / "t.txt").write_text("the cat sat")
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1,
                                 "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 8,
                                 "max_position_embeddings": 64}))
    base = ["--device", "cpu", "--seq", "16", "--data", str(tmp_path / "t.txt")]
    assert trainer.main(base + ["--config", str(small), "--tokenizer", str(work / "tok")]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {work / 'tok'}: its vocabulary has 16 tokens, more than the model's 8 (vocab_size)" in err
    assert trainer.main(base) == 2
    assert "--data: the data is text: give the tokenizer to read it with, --tokenizer DIR" in capsys.readouterr().err
    assert list(tmp_path.glob("*.tokens-*")) == []
    assert trainer.main(base + ["--tokenizer", str(work / "tok"), "--eval-every", "2"]) == 2
    assert "--eval-every 2 evaluates on held-out data: it needs --eval-data" in capsys.readouterr().err

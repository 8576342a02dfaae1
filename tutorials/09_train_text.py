"""
From text to a trained model
============================

``schedlang train`` takes text and a tokenizer, trains any HF causal LM on it, measures a held-out
loss as it goes, and exports a model ``transformers`` loads. This tutorial does it end to end on a
CPU in well under a minute:

1. write a small corpus (``.jsonl``, one document per line) and a held-out file;
2. train a tokenizer on it (the ``tokenizers`` library) and save it as transformers does;
3. write the ``config.json`` of a tiny Qwen3 (any family ``AutoModelForCausalLM`` builds works);
4. ask for the plan (``--dry-run``): layout, memory per rank, collectives, estimated step time;
5. train with held-out evaluation, metrics and a plot of the curves;
6. load the export with ``transformers`` and let it continue a sentence.

Run it as a plain script::

    python tutorials/09_train_text.py

On GPUs the same command line runs under ``torchrun`` (add ``--nproc_per_node=N``): without
``--dp/--tp/--pp`` the trainer chooses the layout itself, and the defaults become bf16, per-layer
compile, ``optimize_model`` and the fused AdamW.
"""

# %%
# A corpus and a held-out set
# ---------------------------
# The "documents" are short sentences from a tiny grammar, so that a small model can learn them in
# a few steps and the held-out loss visibly falls. Real data is the same format: one JSON object per
# line with the document in ``text`` (other fields are ignored), or ``.txt`` files (one document
# each), or a directory of either.

import json
import random
import tempfile
from pathlib import Path

work = Path(tempfile.mkdtemp(prefix="schedlang-text-"))
rng = random.Random(0)
subjects, verbs, objects = ["the cat", "a dog", "the bird", "my friend"], ["sees", "likes", "follows"], [
    "the ball", "a tree", "the moon", "the river"]


def sentence() -> str:
    return " ".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} ." for _ in range(3))


(work / "train.jsonl").write_text("".join(json.dumps({"text": sentence()}) + "\n" for _ in range(400)))
(work / "heldout.jsonl").write_text("".join(json.dumps({"text": sentence()}) + "\n" for _ in range(60)))
print((work / "train.jsonl").read_text().splitlines()[0])

# %%
# A tokenizer
# -----------
# A word-level tokenizer trained on the corpus, saved with ``save_pretrained`` so that
# ``AutoTokenizer.from_pretrained`` (which is what ``--tokenizer DIR`` calls, offline) loads it. Its
# EOS token separates the documents when the trainer packs them into sequences.

from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.train_from_iterator((json.loads(line)["text"] for line in (work / "train.jsonl").read_text().splitlines()),
                        trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(work / "tok")
print(f"tokenizer: {tok.get_vocab_size()} tokens")

# %%
# A model config
# --------------
# A Qwen3 (grouped-query attention with per-head norms) of two layers. Its vocabulary must hold the
# tokenizer's: the trainer refuses a tokenizer whose ids would fall outside the embedding.

from transformers import Qwen3Config  # noqa: E402

Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=64, max_position_embeddings=128, tie_word_embeddings=True,
            eos_token_id=1, bos_token_id=1, pad_token_id=0).save_pretrained(work / "model")

# %%
# The plan, before anything is allocated
# --------------------------------------
# ``--dry-run`` builds the model on the meta device only and prints what the run would do. With
# ``--nproc 2`` and no layout flags it also shows the layout ``--layout auto`` would choose, and why.

from schedlang import train  # noqa: E402

common = ["--config", str(work / "model"), "--data", str(work / "train.jsonl"), "--tokenizer", str(work / "tok"),
          "--global-batch", "8", "--seq", "32", "--device", "cpu"]
assert train.main(common + ["--dry-run", "--nproc", "2"]) == 0

# %%
# Training with held-out evaluation
# ---------------------------------
# The text is tokenized once into a token cache beside the data (``train.jsonl.tokens-<hash>.bin``);
# a second run with the same text and tokenizer reuses it. Every 10 steps the loss on the first
# batches of ``heldout.jsonl`` is measured and logged as ``eval_loss``; ``--plot`` draws the loss
# and throughput curves at the end, ``--metrics`` keeps one JSON line per step.

summary_file = work / "metrics.jsonl"
assert train.main(common + ["--steps", "20", "--lr", "1e-2", "--warmup", "3", "--eval-data", str(work / "heldout.jsonl"),
                            "--eval-every", "10", "--eval-batches", "2", "--metrics", str(summary_file),
                            "--plot", str(work / "curves.png"), "--export-hf", str(work / "export")]) == 0
records = [json.loads(line) for line in summary_file.read_text().splitlines()]
evals = [(r["step"], round(r["eval_loss"], 3)) for r in records if "eval_loss" in r]
print(f"train loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}; eval loss by step {evals}")
assert evals[-1][1] < evals[0][1]
print("token cache:", sorted(p.name for p in work.glob("train.jsonl.tokens-*")))
print("curves drawn by --plot:", work / "curves.png")

# %%
# The loss curves
# ---------------
# The metrics file holds everything ``--plot`` draws; here the training loss of every step and the
# held-out loss of every evaluation, read back from it.

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # no display needed: the gallery and CI render to files
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(6.5, 3.4))
ax.plot([r["step"] for r in records], [r["loss"] for r in records], "-", color="tab:blue", label="training loss")
ax.plot([step for step, _ in evals], [loss for _, loss in evals], "o--", color="tab:orange",
        label="held-out loss (eval_loss)")
ax.set_xlabel("step")
ax.set_ylabel("cross-entropy (nats per token)")
ax.set_title("Qwen3, 2 layers, trained by schedlang train on the CPU", fontsize=9)
ax.legend()
fig.tight_layout()
plt.show()

# %%
# The exported model in transformers
# ----------------------------------
# ``--export-hf`` wrote a directory ``from_pretrained`` loads: the trained weights, the config, and
# nothing of schedlang. It continues a sentence of the grammar it learned.

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

model = AutoModelForCausalLM.from_pretrained(work / "export").eval()
tokenizer = AutoTokenizer.from_pretrained(work / "tok")
ids = tokenizer("the cat sees", return_tensors="pt", add_special_tokens=False)["input_ids"]
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
print("generated:", tokenizer.decode(out[0]))

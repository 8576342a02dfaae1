"""
Long context: splitting the sequence
====================================

A transformer's activations grow with the sequence: past some length one sequence no longer fits one
GPU, however the weights are split. Context parallelism splits the sequence itself over ``cp`` ranks.
Everything in a decoder layer but attention works token by token, so each rank runs its share of the
tokens through the whole model unchanged; attention is the one exchange: every layer all-gathers the
keys and values of the other ranks' tokens.

This tutorial

* splits a HuggingFace LLaMA's sequence over two ranks with one primitive, ``sch.context_parallel()``;
* checks that the loss, the logits and every parameter's gradient equal those of one process;
* and plots what it buys: the planner's estimate of the memory per GPU of LLaMA-3-8B against the
  sequence length, with and without context parallelism.

Run it as a plain script on CPU (two gloo ranks)::

    python tutorials/10_long_context.py
"""

# %%
# The split
# ---------
# With ``cp`` ranks the sequence is cut into ``2 cp`` chunks; rank ``r`` holds chunks ``r`` and
# ``2 cp - 1 - r``. Under a causal mask a late token attends to more keys than an early one, so a
# rank holding one early and one late chunk does as much work as any other: none idles.

import matplotlib

matplotlib.use("Agg")  # no display needed: the gallery and CI render to files
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import schedlang  # noqa: E402
from schedlang.autotune.training_cost import Hardware, Layout, ModelShape, estimate_step  # noqa: E402
from schedlang.distributed.context_parallel import chunk_order, local_positions  # noqa: E402
from schedlang.distributed.mesh import make_mesh  # noqa: E402

SEQ = 96  # a multiple of 2 x cp = 4

for rank, chunks in enumerate(chunk_order(2)):
    positions = local_positions(16, 2, rank).tolist()
    print(f"cp rank {rank}: chunks {chunks}, positions of a 16-token sequence {positions}")

# %%
# One primitive, one loss helper
# ------------------------------
# ``context_parallel`` needs a mesh with a ``cp`` dimension (``make_mesh(cp=2)``; it composes with
# ``dp``, ``tp`` and HSDP). Applied to the causal LM, every forward keeps this rank's tokens of the full
# batch, with their global positions for the rotary embedding, and every attention layer runs
# schedlang's context-parallel attention (registered in transformers' ``AttentionInterface``). The
# logits stay split; :func:`schedlang.context_parallel_loss` shifts the labels on the full sequence,
# keeps this rank's, and sums the token losses and their count over ``cp``.
#
# Each rank's gradients cover only its tokens. ``build`` averages them over ``cp`` (FSDP2 and DDP run
# on the data dimension and ``cp`` flattened; without them a gradient hook does), and the loss's
# gradient is scaled so that average is the single process's gradient.


def tiny_model():
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def train_one_step(rank, world):
    reference = tiny_model()
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ref = reference(tokens, labels=tokens)
    ref.loss.backward()

    sch = schedlang.create_schedule(tiny_model(), mesh=make_mesh(cp=2))
    sch.context_parallel()
    model, _ = schedlang.build(sch)
    logits = model(tokens).logits  # this rank's 48 tokens of each sequence
    loss = schedlang.context_parallel_loss(logits, tokens, model)
    loss.backward()
    whole = schedlang.gather_context_parallel(logits.detach(), 1, model)  # back in global order
    grads = {n: p.grad for n, p in model.named_parameters()}
    worst = max(float((grads[n] - p.grad).abs().max()) for n, p in reference.named_parameters())
    return {"local_tokens": logits.shape[1], "loss": float(loss.detach()), "single": float(ref.loss.detach()),
            "logits": float((whole - ref.logits.detach()).abs().max()), "grads": worst}


results = schedlang.launch(train_one_step, world_size=2)
for rank, r in enumerate(results):
    print(f"rank {rank}: {r['local_tokens']} of {SEQ} tokens, loss {r['loss']:.6f} (one process {r['single']:.6f}); "
          f"largest difference: logits {r['logits']:.1e}, gradients {r['grads']:.1e}")

# %%
# What it buys
# ------------
# The planner (``schedlang.autotune.training_cost``, the trainer's ``--dry-run``) estimates the memory
# of one training step per GPU. Below, LLaMA-3-8B on one node of eight 80 GiB GPUs, one sequence per
# data-parallel rank, bf16 with full activation checkpointing and FSDP2 over every data (and cp)
# rank: with ``cp`` ranks a GPU keeps ``1 / cp`` of each sequence's activations, at the price of a
# K/V all-gather per layer. These are the planner's estimates, not measurements.

LLAMA3_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                       vocab=128256, params=8_030_261_248, flops_params=7_504_924_672,
                       embedding_params=1_050_673_152)
GPUS = 8
hardware = Hardware.nominal("cuda", memory_gib=80, world=GPUS, gpus_per_node=GPUS)
lengths = [4096 * 2 ** i for i in range(6)]  # 4k .. 128k tokens
fig, ax = plt.subplots(figsize=(6, 3.6))
for cp in (1, 2, 4, 8):
    layout = Layout(dp=GPUS // cp, cp=cp, dtype="bf16", activation_checkpoint="full")
    peak = [estimate_step(LLAMA3_8B, layout, hardware, global_batch=GPUS // cp, seq=n).total_bytes / 2 ** 30
            for n in lengths]
    ax.plot([n // 1024 for n in lengths], peak, marker="o", label=f"cp={cp}, dp={GPUS // cp}")
    fits = [n for n, p in zip(lengths, peak) if p <= 80 * 0.9]
    print(f"cp={cp}: longest sequence that fits (of those plotted): {max(fits) // 1024 if fits else 0}k tokens")
ax.axhline(80, color="grey", linestyle="--", linewidth=1)
ax.text(4, 82, "80 GiB", color="grey")
ax.set_xscale("log", base=2)
ax.set_yscale("log", base=2)
ax.set_xlabel("sequence length (k tokens)")
ax.set_ylabel("peak memory per GPU (GiB)")
ax.set_title("LLaMA-3-8B, 8 GPUs: planner's estimate")
ax.legend(fontsize=8)
fig.tight_layout()

# %%
# In the trainer
# --------------
# ``--cp N`` runs the same split (world = pp x dp x cp x tp)::
#
#     python -m schedlang.train --model llama --config tiny --nproc 2 --cp 2 --seq 64 --device cpu
#
# ``--seq`` must be a multiple of ``2 x cp``; the dry run (``--dry-run --json``) plans with the real
# ``cp``. What it does not do yet: pipeline stages together with ``--cp``, padding masks, and attention
# sinks (gpt-oss), which ``context_parallel`` refuses by name.

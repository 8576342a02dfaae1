"""
Tensor-parallel LLaMA in a few schedule lines
=============================================

This tutorial splits a HuggingFace LLaMA (``transformers`` 5.x) over two ranks, Megatron
style, without editing the model: attention heads, MLP columns, the embedding table and the
LM head are sharded; the loss is computed on logits that stay split along the vocabulary;
optionally the norms and residuals are split along the sequence (sequence parallelism); and
each rank can materialize only its own shards of a model created on the meta device.

Run it as a plain script on CPU (it starts two gloo ranks itself)::

    python tutorials/03_tensor_parallel.py

or on two GPUs (NCCL), or two CPU processes (gloo), started by torchrun::

    torchrun --nproc_per_node=2 tutorials/03_tensor_parallel.py
"""

# %%
# Setup
# -----
# The work of each rank lives in functions; :func:`schedlang.launch` runs one on every rank
# and returns what each rank returned. As a plain script (and on this page) it starts two local
# gloo ranks for each call; under ``torchrun`` this process is one of the ranks and the function
# runs here. A rank runs only this file's imports, functions and UPPER_CASE constants, so the
# top-level code (the calls to ``launch``, the figures) runs once, in the launching process.
# What rank 0 prints appears below each cell.

import copy

import matplotlib

matplotlib.use("Agg")  # no display needed: the gallery and CI render to files
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import schedlang  # noqa: E402
from schedlang.distributed.collectives import all_gather_tensor  # noqa: E402
from schedlang.models.llama import shard_llama  # noqa: E402

WORLD = 2
STEPS = 6


def tiny_llama_config():
    config = LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=256, vocab_size=512, max_position_embeddings=128)
    config._attn_implementation = "sdpa"
    return config


def device_of_rank():
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def say(*args):
    """Print once: on rank 0, or in the launching process (under torchrun, rank 0 is both)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def model_and_batch():
    """The same weights and token ids on every rank (seed 0)."""
    device = device_of_rank()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).to(device)
    ids = torch.randint(0, 512, (2, 32), device=device)
    return model, ids


def local(p):
    """The part of a parameter this rank holds: a sharded parameter is a DTensor, whose shape is the
    whole tensor's and whose local tensor is the rank's shard."""
    return p.to_local() if isinstance(p, DTensor) else p


# %%
# The schedule, checked by Verify
# -------------------------------
# ``shard_llama`` writes the ``shard`` and ``sync`` steps of Megatron-LM's layout into the
# schedule: q/k/v and gate/up split along their outputs (column parallel), o_proj and
# down_proj along their inputs (row parallel) followed by an all-reduce, the input gradient
# of each block all-reduced in backward, the embedding and LM head split along the
# vocabulary. ``Verify`` runs the original and the scheduled model on the same inputs and
# compares outputs and every gradient (a shard's against the slice of the full gradient).
# The logits stay split over the vocabulary: the LM head's record says which slice each rank
# holds, and Verify compares it with that slice of the original's logits.
def verify_the_schedule(rank, world):
    model, ids = model_and_batch()
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]) as check:
        shard_llama(sch)
    say(f"Verify passed on {world} ranks; {[n for n in check.report.notes if 'vocabulary' in n][0]}")
    say("the first steps of the plan:")
    say("\n".join(str(sch.plan).splitlines()[:9]))
    attn = sch["model.layers.0.self_attn"].mod
    say(f"each rank holds {attn.num_heads} of 8 query heads and {attn.num_key_value_heads} of 4 key/value heads")


schedlang.launch(verify_the_schedule, world_size=WORLD)

# %%
# Training with split logits
# --------------------------
# Gathering the logits costs an all-gather of ``tokens x vocab`` values; the loss does not
# need it. By default ``shard_llama`` keeps the logits split along the vocabulary and
# replaces the model's loss by the vocabulary-parallel cross entropy (three all-reduces of
# one value per token). Each rank trains the split model and, beside it, the whole model alone;
# the losses agree step by step.
def train_with_split_logits(rank, world):
    model, ids = model_and_batch()
    sch = schedlang.create_schedule(model)
    shard_llama(sch)
    tp_model, opt = schedlang.build(sch, optimizer=torch.optim.AdamW, lr=1e-3)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for step in range(STEPS):
        out = tp_model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(out.loss.item())
        ref_losses.append(ref_loss.item())
        say(f"step {step}: loss {losses[-1]:.5f} (single device {ref_losses[-1]:.5f}); "
            f"logits per rank {tuple(out.logits.shape)}")
    full_logits = all_gather_tensor(out.logits.detach().contiguous(), axis=-1)
    say(f"gathered logits: {tuple(full_logits.shape)}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-4)
    return losses, ref_losses


tp_losses, single_losses = schedlang.launch(train_with_split_logits, world_size=WORLD)[0]

# %%
# The two curves lie on each other: tensor parallelism changes where the work runs, not what it
# computes.
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot(range(STEPS), single_losses, "o-", color="0.6", linewidth=4, label="one process, whole model")
ax.plot(range(STEPS), tp_losses, "x--", color="C3", label=f"tensor parallel, {WORLD} ranks, split logits")
ax.set_xlabel("training step")
ax.set_ylabel("loss")
ax.set_title("Training loss: tensor parallel against one process")
ax.legend()
fig.tight_layout()
plt.show()

# %%
# Sequence parallelism
# --------------------
# Between the parallel regions the activations are the same on every rank. Sequence
# parallelism splits them along the sequence instead: the row-parallel outputs are
# reduce-scattered, the RMSNorms run on sequence shards (their weight gradients are summed
# over the ranks) and are all-gathered before the next projections. Same communication
# volume, ``1 / world`` of the norm work and activation memory.
def verify_sequence_parallel(rank, world):
    model, ids = model_and_batch()
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]):
        shard_llama(sch, sequence_parallel=True, gather_logits=True)
    say("sequence parallelism: Verify passed;", sch["model.layers.0.input_layernorm"].mod.__class__.__name__)


schedlang.launch(verify_sequence_parallel, world_size=WORLD)

# %%
# Only your shards in memory
# --------------------------
# A model created under ``schedlang.init_empty_weights()`` has no parameter memory. The
# same schedule is applied to it, and ``build`` allocates and initializes each rank's shards
# only, using the model's own (HF) initialization on a temporary full-size copy of one
# module at a time: the shards equal the slices of the unsharded model built with the same
# seed.
def only_this_ranks_shards(rank, world):
    device = device_of_rank()
    with schedlang.init_empty_weights():
        meta = LlamaForCausalLM(tiny_llama_config())
    sch = schedlang.create_schedule(meta)
    shard_llama(sch)
    torch.manual_seed(1)
    sharded, _ = schedlang.build(sch, device=device)
    torch.manual_seed(1)
    full, _ = schedlang.build(schedlang.create_schedule(meta), device=device)
    q_shard = local(sharded.model.layers[0].self_attn.q_proj.weight)
    q_full = full.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(q_shard, q_full.chunk(world)[rank])
    say(f"this rank's q_proj shard {tuple(q_shard.shape)} equals its rows of the unsharded {tuple(q_full.shape)}")
    mib = lambda m: sum(local(p).numel() * p.element_size() for p in m.parameters()) / 2 ** 20  # noqa: E731
    return mib(sharded), mib(full)


per_rank = schedlang.launch(only_this_ranks_shards, world_size=WORLD)
say(f"parameters per rank: {', '.join(f'{mine:.2f} MiB' for mine, _ in per_rank)} of {per_rank[0][1]:.2f} MiB")

# %%
# Each rank holds a little over half of the parameters: the norms are replicated, everything
# else is split.
fig, ax = plt.subplots(figsize=(6, 2.6))
names = ["unsharded model"] + [f"rank {r}" for r in range(WORLD)]
sizes = [per_rank[0][1]] + [mine for mine, _ in per_rank]
ax.barh(names[::-1], sizes[::-1], color=["C0"] * WORLD + ["0.6"])
for y, size in enumerate(sizes[::-1]):
    ax.text(size, y, f" {size:.2f} MiB", va="center")
ax.set_xlim(0, max(sizes) * 1.3)
ax.set_xlabel("parameter memory (MiB)")
ax.set_title("Parameters held by each rank")
fig.tight_layout()
plt.show()

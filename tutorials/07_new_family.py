"""
Tensor parallelism for a new model family
=========================================

``schedlang.models`` finds a tensor-parallel plan for most HuggingFace models by itself, and a few
families (LLaMA, GPT-2, BERT) adjust that automatic plan with options of their own. This tutorial
writes a schedule for HuggingFace OPT by hand, from scratch: find the attention and the MLP, shard
their projections, place the synchronizations, check the result with ``Verify``, and register the
schedule so that ``shard_model`` uses it. Then it lets ``shard_model`` find the same plan by
itself, with sequence parallelism, and shows how a family overrides the automatic plan.

Run it as a plain script on CPU (it starts two gloo ranks itself)::

    python tutorials/07_new_family.py

or on two GPUs (or two CPU processes) started by torchrun::

    torchrun --nproc_per_node=2 tutorials/07_new_family.py
"""

# %%
# Setup
# -----
# A tiny OPT built from a config (random weights, no download). The work of each rank lives in
# functions; :func:`schedlang.launch` runs one on every rank (two local gloo ranks, kept from one
# call to the next; under ``torchrun``, the ranks torchrun started) and returns what each returned.
# A rank runs only this file's imports, functions and UPPER_CASE constants. What rank 0 prints
# appears below each cell.

import matplotlib

matplotlib.use("Agg")  # no display needed: the gallery and CI render to files
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import OPTConfig, OPTForCausalLM  # noqa: E402

import schedlang  # noqa: E402
from schedlang.models import FAMILIES, register_family, shard_model  # noqa: E402
from schedlang.models.auto import apply_tensor_parallel, plan_tensor_parallel  # noqa: E402

WORLD = 2


def tiny_opt_config():
    config = OPTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, ffn_dim=128, vocab_size=256,
                       max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    return config


def say(*args):
    """Print once: on rank 0, or in the launching process (under torchrun, rank 0 is both)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def model_and_batch():
    """The same weights and token ids on every rank (seed 0)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    torch.manual_seed(0)
    return OPTForCausalLM(tiny_opt_config()).to(device), torch.randint(2, 256, (2, 16), device=device)


# %%
# Step 1: find the attention and the MLP
# --------------------------------------
# ``print(model)`` shows the structure. In OPT each decoder layer holds ``self_attn`` (with
# ``q_proj``, ``k_proj``, ``v_proj`` computing the heads and ``out_proj`` combining them) and,
# directly in the layer, the MLP: ``fc1`` -> activation -> ``fc2``. Megatron's layout splits the
# first projection of each pair along its outputs (column parallel: every rank computes its own
# heads, or its own slice of the MLP's hidden units) and the second along its inputs (row
# parallel: every rank computes a partial sum, added up by an all-reduce).
#
# Step 2: the schedule, step by step
# ----------------------------------
# * column projections: ``shard("weight", axis=0)`` and their bias along axis 0;
# * row projections: ``shard("weight", axis=1)`` then a ``fwd_post`` all-reduce of the output
#   (the bias is added once, after it);
# * in backward, each rank's input gradient of a column-parallel block covers only its part:
#   a ``bwd_post`` all-reduce on the block's input sums it (on ``self_attn``, which receives the
#   normalized hidden states; on ``fc1``, since the layer's own input also feeds the residual);
# * the token embedding and the tied LM head split along the vocabulary: the lookups are
#   all-reduced, and with ``gather_logits`` the logits all-gathered.
#
# Splitting q/k/v changes how many heads each rank has, and ``OPTAttention.forward`` reshapes with
# ``self.num_heads``. No code is needed for it: the generic shard rule reads the forward, finds
# that attribute and sets it to the local count (and refuses splits that cut heads).


def shard_opt(sch, gather_logits: bool = False):
    decoder = sch["model.decoder"]
    for name in decoder["layers"].child:
        layer = decoder[f"layers.{name}"]
        attn = layer["self_attn"]
        for proj in ("q_proj", "k_proj", "v_proj"):
            attn[proj].shard("weight", axis=0)
            attn[proj].shard("bias", axis=0)
        attn["out_proj"].shard("weight", axis=1)
        attn["out_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        attn.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        layer["fc1"].shard("weight", axis=0)
        layer["fc1"].shard("bias", axis=0)
        layer["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        layer["fc2"].shard("weight", axis=1)
        layer["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    embed = decoder["embed_tokens"]
    embed.shard("weight", axis=0)            # the tied lm_head is sharded with it
    embed.sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["lm_head"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    if gather_logits:
        # the loss after it is replicated: the gather's backward only slices the gradient
        sch["lm_head"].sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-1, tensor_parallel_output_grad=False)
    return sch



# %%
# Step 3: verify
# --------------
# ``Verify`` runs the original and the scheduled model on the same inputs and compares the
# logits and every gradient (each shard against its slice of the full gradient).
def verify_the_hand_written_schedule(rank, world):
    model, ids = model_and_batch()
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]):
        shard_opt(sch, gather_logits=True)
    attn = sch["model.decoder.layers.0.self_attn"].mod
    say(f"hand-written schedule verified on {world} ranks: {len(sch.plan)} steps, "
        f"{attn.num_heads} of {model.config.num_attention_heads} heads per rank")
    return parameters_by_kind(model), parameters_by_kind(sch.mod)


def parameters_by_kind(model):
    """How many parameters (of its own shards, on a sharded model) this rank holds, by kind of module."""
    kinds = {"attention": ("self_attn.",), "MLP": ("fc1.", "fc2."), "embeddings": ("embed_",),
             "norms": ("layer_norm.", "final_layer_norm.")}
    counts = dict.fromkeys(kinds, 0)
    for name, p in model.named_parameters():
        for kind, marks in kinds.items():
            if any(mark in name for mark in marks):
                counts[kind] += (p.to_local() if isinstance(p, DTensor) else p).numel()
                break
    return counts


full_counts, shard_counts = schedlang.launch(verify_the_hand_written_schedule, world_size=WORLD)[0]
say(f"parameters on rank 0: {sum(shard_counts.values()):,} of {sum(full_counts.values()):,}")

# %%
# What each rank holds: half of every projection and of the token embedding (its vocabulary
# rows), and whole copies of the small rest: the learned position embeddings and every LayerNorm.
fig, ax = plt.subplots(figsize=(6, 3))
kinds = list(full_counts)
ax.bar([i - 0.2 for i in range(len(kinds))], [full_counts[k] for k in kinds], width=0.4, color="0.6",
       label="unsharded model")
ax.bar([i + 0.2 for i in range(len(kinds))], [shard_counts[k] for k in kinds], width=0.4, color="C0",
       label=f"one of {WORLD} ranks")
ax.set_xticks(range(len(kinds)), kinds)
ax.set_ylabel("parameters")
ax.set_title("OPT under the hand-written schedule: parameters per rank")
ax.legend()
fig.tight_layout()
plt.show()

# %%
# Step 4: register it
# -------------------
# ``register_family(prefix, fn)`` makes ``shard_model`` use ``fn`` for every model whose class
# name starts with ``prefix`` (``OPTForCausalLM``, ``OPTModel`` ...).
def shard_model_uses_the_registered_schedule(rank, world):
    model, ids = model_and_batch()
    register_family("OPT", shard_opt)
    try:
        sch = schedlang.create_schedule(model)
        with schedlang.Verify(sch, example_inputs=[ids]):
            plan = shard_model(sch, gather_logits=True)
    finally:
        FAMILIES.pop("OPT")
    say(f"shard_model used the registered schedule: {plan.schedule} ({plan.steps} steps)")


schedlang.launch(shard_model_uses_the_registered_schedule, world_size=WORLD)

# %%
# Step 5: or let shard_model find the plan
# ----------------------------------------
# Without a registered schedule, ``shard_model`` finds the layers, follows the dataflow of each
# block's forward (q/k/v feed out_proj, fc1 feeds fc2) and writes the same kind of plan. It
# returns a description of what it chose.
def the_automatic_plan(rank, world):
    model, ids = model_and_batch()
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]):
        plan = shard_model(sch, gather_logits=True)
    say("the automatic plan, verified:")
    say(plan)


schedlang.launch(the_automatic_plan, world_size=WORLD)

# %%
# Step 6: sequence parallelism
# ----------------------------
# ``sequence_parallel=True`` also splits what runs between the blocks (norms, residuals, dropouts)
# along the sequence: the first layer keeps each rank's slice, every block all-gathers its input
# and reduce-scatters its output, and the norms' weight gradients are summed. The sequence length
# (16 here) must be divisible by the number of ranks.
def with_sequence_parallelism(rank, world):
    model, ids = model_and_batch()
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]):
        plan = shard_model(sch, sequence_parallel=True, gather_logits=True)
    say(f"with sequence parallelism, verified: sequence_parallel={plan.sequence_parallel}, {plan.steps} steps")


schedlang.launch(with_sequence_parallelism, world_size=WORLD)

# %%
# Overriding the automatic plan
# -----------------------------
# A family whose layout the dataflow cannot find, or that wants options of its own, changes the
# plan before applying it: ``plan_tensor_parallel`` finds it, ``apply_tensor_parallel`` writes it.
# This is all ``shard_llama`` does for ``grad_sync="norm"`` (the input gradients summed at the norm
# in front of each block); ``shard_bert`` names BERT's blocks with ``layer_plan``, since its
# attention spans two modules. Here every block sums its input gradient at each column projection
# (plain pre-hooks on the Linears) instead of on the block's input:
def shard_opt_column_syncs(sch, gather_logits=False, sequence_parallel=False):
    plan = plan_tensor_parallel(sch, gather_logits=gather_logits, sequence_parallel=sequence_parallel)
    for block in plan.all_blocks:
        block.grad_sync = "columns"
    plan.schedule = "shard_opt_column_syncs"
    return apply_tensor_parallel(sch, plan)


def the_override(rank, world):
    model, ids = model_and_batch()
    register_family("OPT", shard_opt_column_syncs)
    try:
        sch = schedlang.create_schedule(model)
        with schedlang.Verify(sch, example_inputs=[ids]):
            plan = shard_model(sch, gather_logits=True)
    finally:
        FAMILIES.pop("OPT")
    say(f"the override, verified: {plan.schedule}")
    say(plan)


schedlang.launch(the_override, world_size=WORLD)

# %%
# When the generic rule cannot tell
# ---------------------------------
# If a module's forward reads an attribute whose meaning the generic rule cannot tell, or a
# fused projection's layout cannot be read, ``shard`` raises a ``ShardError`` naming the class
# and the attributes found. Register a rule for that class then: a
# ``schedlang.distributed.shard_rules.ShardRule`` subclass with ``module_type_names`` and the
# ``check_child_shard`` / ``after_child_shard`` hooks (see ``attention.py`` in that package).

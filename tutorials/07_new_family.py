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

or on two GPUs::

    torchrun --nproc_per_node=2 tutorials/07_new_family.py
"""

# %%
# Setup
# -----
# A tiny OPT built from a config (random weights, no download). Every rank runs ``main``.

import os

import torch
import torch.distributed as dist
from transformers import OPTConfig, OPTForCausalLM

import schedlang
from schedlang.models import FAMILIES, register_family, shard_model


def tiny_opt_config():
    config = OPTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, ffn_dim=128, vocab_size=256,
                       max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    return config


def say(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


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


def main(rank, world):
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    torch.manual_seed(0)
    model = OPTForCausalLM(tiny_opt_config()).to(device)
    ids = torch.randint(2, 256, (2, 16), device=device)

    # %%
    # Step 3: verify
    # --------------
    # ``Verify`` runs the original and the scheduled model on the same inputs and compares the
    # logits and every gradient (each shard against its slice of the full gradient).
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]):
        shard_opt(sch, gather_logits=True)
    attn = sch["model.decoder.layers.0.self_attn"].mod
    say(f"hand-written schedule verified on {world} ranks: {len(sch.plan)} steps, "
        f"{attn.num_heads} of {model.config.num_attention_heads} heads per rank")

    # %%
    # Step 4: register it
    # -------------------
    # ``register_family(prefix, fn)`` makes ``shard_model`` use ``fn`` for every model whose class
    # name starts with ``prefix`` (``OPTForCausalLM``, ``OPTModel`` ...).
    register_family("OPT", shard_opt)
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]):
        plan = shard_model(sch, gather_logits=True)
    say(f"shard_model used the registered schedule: {plan.schedule} ({plan.steps} steps)")

    # %%
    # Step 5: or let shard_model find the plan
    # ----------------------------------------
    # Without a registered schedule, ``shard_model`` finds the layers, follows the dataflow of each
    # block's forward (q/k/v feed out_proj, fc1 feeds fc2) and writes the same kind of plan. It
    # returns a description of what it chose.
    FAMILIES.pop("OPT")
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]):
        plan = shard_model(sch, gather_logits=True)
    say("the automatic plan, verified:")
    say(plan)

    # %%
    # Step 6: sequence parallelism
    # ----------------------------
    # ``sequence_parallel=True`` also splits what runs between the blocks (norms, residuals, dropouts)
    # along the sequence: the first layer keeps each rank's slice, every block all-gathers its input
    # and reduce-scatters its output, and the norms' weight gradients are summed. The sequence length
    # (16 here) must be divisible by the number of ranks.
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]):
        plan = shard_model(sch, sequence_parallel=True, gather_logits=True)
    say(f"with sequence parallelism, verified: sequence_parallel={plan.sequence_parallel}, {plan.steps} steps")

    # %%
    # Overriding the automatic plan
    # -----------------------------
    # A family whose layout the dataflow cannot find, or that wants options of its own, changes the
    # plan before applying it: ``plan_tensor_parallel`` finds it, ``apply_tensor_parallel`` writes it.
    # This is all ``shard_llama`` does for ``grad_sync="norm"`` (the input gradients summed at the norm
    # in front of each block); ``shard_bert`` names BERT's blocks with ``layer_plan``, since its
    # attention spans two modules. Here every block sums its input gradient at each column projection
    # (plain pre-hooks on the Linears) instead of on the block's input:
    from schedlang.models.auto import apply_tensor_parallel, plan_tensor_parallel

    def shard_opt_column_syncs(sch, gather_logits=False, sequence_parallel=False):
        plan = plan_tensor_parallel(sch, gather_logits=gather_logits, sequence_parallel=sequence_parallel)
        for block in plan.all_blocks:
            block.grad_sync = "columns"
        plan.schedule = "shard_opt_column_syncs"
        return apply_tensor_parallel(sch, plan)

    register_family("OPT", shard_opt_column_syncs)
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]):
        plan = shard_model(sch, gather_logits=True)
    FAMILIES.pop("OPT")
    say(f"the override, verified: {plan.schedule}")
    say(plan)

    # %%
    # When the generic rule cannot tell
    # ---------------------------------
    # If a module's forward reads an attribute whose meaning the generic rule cannot tell, or a
    # fused projection's layout cannot be read, ``shard`` raises a ``ShardError`` naming the class
    # and the attributes found. Register a rule for that class then: a
    # ``schedlang.distributed.shard_rules.ShardRule`` subclass with ``module_type_names`` and the
    # ``check_child_shard`` / ``after_child_shard`` hooks (see ``attention.py`` in that package).


# %%
# Launching
# ---------
if __name__ == "__main__":
    if "RANK" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        main(dist.get_rank(), dist.get_world_size())
        dist.destroy_process_group()
    else:
        from schedlang.distributed.launch import run_distributed

        run_distributed(main, world_size=2, timeout=300)

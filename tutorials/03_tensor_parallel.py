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

or on two GPUs (NCCL)::

    torchrun --nproc_per_node=2 tutorials/03_tensor_parallel.py
"""

# %%
# Setup
# -----
# Every rank runs the same script. Under ``torchrun`` the process group comes from the
# environment; as a plain script, ``main`` is started on two local gloo ranks by
# :func:`schedlang.distributed.launch.run_distributed` (see the end of the file).

import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

import schedlang
from schedlang.distributed.collectives import all_gather_tensor
from schedlang.models.llama import shard_llama


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
    if dist.get_rank() == 0:
        print(*args, flush=True)


def main(rank, world):
    device = device_of_rank()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).to(device)
    ids = torch.randint(0, 512, (2, 32), device=device)

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
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]) as check:
        shard_llama(sch)
    say(f"Verify passed on {world} ranks; {[n for n in check.report.notes if 'vocabulary' in n][0]}")
    say("the first steps of the plan:")
    say("\n".join(str(sch.plan).splitlines()[:9]))
    attn = sch["model.layers.0.self_attn"].mod
    say(f"each rank holds {attn.num_heads} of 8 query heads and {attn.num_key_value_heads} of 4 key/value heads")

    # %%
    # Training with split logits
    # --------------------------
    # Gathering the logits costs an all-gather of ``tokens x vocab`` values; the loss does not
    # need it. By default ``shard_llama`` keeps the logits split along the vocabulary and
    # replaces the model's loss by the vocabulary-parallel cross entropy (three all-reduces of
    # one value per token). The loss equals the single-device model's.
    sch = schedlang.create_schedule(model)
    shard_llama(sch)
    tp_model, opt = schedlang.build(sch, optimizer=torch.optim.AdamW, lr=1e-3)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(3):
        out = tp_model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        say(f"step {step}: loss {out.loss.item():.5f} (single device {ref_loss.item():.5f}); "
            f"logits per rank {tuple(out.logits.shape)}")
    full_logits = all_gather_tensor(out.logits.detach().contiguous(), axis=-1)
    say(f"gathered logits: {tuple(full_logits.shape)}")

    # %%
    # Sequence parallelism
    # --------------------
    # Between the parallel regions the activations are the same on every rank. Sequence
    # parallelism splits them along the sequence instead: the row-parallel outputs are
    # reduce-scattered, the RMSNorms run on sequence shards (their weight gradients are summed
    # over the ranks) and are all-gathered before the next projections. Same communication
    # volume, ``1 / world`` of the norm work and activation memory.
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]):
        shard_llama(sch, sequence_parallel=True, gather_logits=True)
    say("sequence parallelism: Verify passed;", sch["model.layers.0.input_layernorm"].mod.__class__.__name__)

    # %%
    # Only your shards in memory
    # --------------------------
    # A model created under ``schedlang.init_empty_weights()`` has no parameter memory. The
    # same schedule is applied to it, and ``build`` allocates and initializes each rank's shards
    # only, using the model's own (HF) initialization on a temporary full-size copy of one
    # module at a time: the shards equal the slices of the unsharded model built with the same
    # seed.
    with schedlang.init_empty_weights():
        meta = LlamaForCausalLM(tiny_llama_config())
    sch = schedlang.create_schedule(meta)
    shard_llama(sch)
    torch.manual_seed(1)
    sharded, _ = schedlang.build(sch, device=device)
    torch.manual_seed(1)
    full, _ = schedlang.build(schedlang.create_schedule(meta), device=device)
    # a sharded parameter is a DTensor: its shape is the whole tensor's, its local tensor the rank's shard
    mib = [sum(local(p).numel() * p.element_size() for p in m.parameters()) / 2 ** 20 for m in (sharded, full)]
    say(f"parameters per rank: {mib[0]:.2f} MiB of {mib[1]:.2f} MiB")
    q_shard = local(sharded.model.layers[0].self_attn.q_proj.weight)
    q_full = full.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(q_shard, q_full.chunk(world)[rank])
    say(f"this rank's q_proj shard {tuple(q_shard.shape)} equals its rows of the unsharded {tuple(q_full.shape)}")


def local(p):
    """The part of a parameter this rank holds."""
    return p.to_local() if isinstance(p, DTensor) else p


# %%
# Launching
# ---------
# Under ``torchrun`` (``RANK`` is set) every process joins the group and runs ``main``;
# otherwise two local ranks are started.
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

"""
From one GPU to a 2-D mesh
==========================

One model, trained under five layouts of ranks, written as schedules of the same unchanged
HuggingFace LLaMA:

* one process (the reference);
* data parallelism with FSDP2: every parameter split over the ``dp`` ranks (``fully_shard``);
* tensor parallelism, Megatron style, over the ``tp`` ranks (``schedlang.models.shard_model``);
* both at once on a 2-D mesh, ``dp=2 x tp=2``;
* and DDP (``replicate``) over bf16 parameters whose fp32 master weights live in the optimizer.

Every layout trains on the same global batch from the same weights, so their losses agree
step by step (to rounding in fp32; the bf16 DDP run to a few parts in ten thousand). A distributed checkpoint saved under one layout then loads under another
(``schedlang.save_checkpoint`` / ``load_checkpoint``): each rank reads the pieces its own
shards cover, weights and AdamW state alike, and training goes on as if nothing had changed.

Run it as a plain script on CPU: it starts two gloo ranks (one process, ``dp=2``, ``tp=2``),
then four (``dp=2 x tp=2``)::

    python tutorials/06_scale_out.py

or under torchrun (NCCL on GPUs, gloo on CPUs), where the 1-D layouts use all the ranks and the 2-D
one needs 4 of them or more::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc_per_node=4 tutorials/06_scale_out.py
"""

# %%
# Setup
# -----
# Every rank runs the same code. The model is tiny (two decoder layers) so that the whole
# tutorial runs on a laptop CPU; nothing below depends on its size. The global batch is fixed
# (8 sequences of 16 tokens, the same on every rank); a data-parallel rank trains on its rows of
# it, and the ranks of a tensor-parallel group share theirs. The labels are the ids shifted by
# one, made once on the host. Everything runs in float32 here, so the layouts agree to
# rounding; for real training ``fully_shard`` computes in bf16 with fp32 gradient reduction
# (its default on a GPU).
#
# The work of each rank lives in functions; :func:`schedlang.launch` runs one on every rank and
# returns what each returned: as a plain script (and on this page) on local gloo ranks, kept from
# one call to the next; under ``torchrun``, on the ranks torchrun started. A rank runs only this
# file's imports, functions and UPPER_CASE constants; the calls to ``launch`` and the figures run
# once, in the launching process. What rank 0 prints appears below each cell.

import os
import shutil
import tempfile

import matplotlib

matplotlib.use("Agg")  # no display needed: the gallery and CI render to files
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import schedlang  # noqa: E402
from schedlang.distributed.cross_entropy import vocab_parallel_cross_entropy  # noqa: E402
from schedlang.distributed.mesh import describe_mesh, make_mesh  # noqa: E402
from schedlang.models import shard_model  # noqa: E402

ROWS, SEQ, STEPS, LR = 8, 16, 3, 3e-3
SHOWN = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
         "model.layers.0.input_layernorm.weight")


def tiny_config():
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=128, vocab_size=256, max_position_embeddings=64)
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


def tiny_llama(device):
    """The unsharded model, the same weights on every rank and in every layout (seed 0)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config()).to(device)


def global_batch(device):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tiny_config().vocab_size, (ROWS, SEQ), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100  # the last position has no next token
    return ids.to(device), labels.to(device)


def mean_over_ranks(value):
    """Each data-parallel rank holds the mean loss of its rows; the global loss is their mean (the ranks of a
    tensor-parallel group hold the same value, so the mean over all ranks is the same thing)."""
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return (value / dist.get_world_size()).item()


# %%
# The loss
# --------
# Under tensor parallelism the LM head is split along the vocabulary, and so are the logits:
# each rank holds ``vocab / tp`` columns. The vocabulary-parallel cross entropy takes the loss
# of the split logits directly (three all-reduces of one value per token instead of an
# all-gather of all the logits). Other layouts have whole logits and take the usual loss.
def loss_of(model, ids, labels, tp_group=None):
    logits = model(input_ids=ids, use_cache=False).logits
    if logits.shape[-1] != tiny_config().vocab_size:
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), group=tp_group)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def train(model, opt, ids, labels, steps, tp_group=None, autocast_dtype=None):
    losses = []
    for _ in range(steps):
        with torch.autocast(ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = loss_of(model, ids, labels, tp_group)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mean_over_ranks(loss))
    return losses


def show_parameters(model, title):
    """What each parameter looks like on this rank: a DTensor's placements say where its pieces are."""
    from torch.distributed.tensor import DTensor

    say(f"  parameters ({title}), on rank 0:")
    for name, p in model.named_parameters():
        if name not in SHOWN:
            continue
        if isinstance(p, DTensor):
            dims = ", ".join(p.device_mesh.mesh_dim_names)
            say(f"    {name:40s} {str(tuple(p.shape)):10s} DTensor over ({dims}) {list(p.placements)}, "
                f"local {tuple(p.to_local().shape)}")
        else:
            say(f"    {name:40s} {str(tuple(p.shape)):10s} plain tensor")


def report(title, losses, reference):
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    say(f"{title:34s} losses {', '.join(f'{x:.5f}' for x in losses)}   (max difference to one process {diff:.1e})")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[:len(losses)]), rtol=1e-4, atol=1e-4)


# %%
# Layouts as schedules
# --------------------
# A layout is a device mesh and a few schedule lines. ``make_mesh`` names the dimensions; the
# product of their sizes is the number of ranks. ``shard_model`` writes the tensor-parallel
# ``shard`` / ``sync`` steps for the model's family (they act on the ``tp`` dimension);
# ``fully_shard`` records FSDP2 on the ``dp`` dimension, on each decoder layer and then on the
# root, which keeps what is left (embeddings, final norm, LM head). ``schedlang.build`` puts
# them on in order: tensor-parallel parameters become DTensors on ``tp``, then FSDP2 splits
# every parameter again along ``dp``. With ``empty=True`` the model is made on the meta device
# and ``build`` allocates each rank's shards only, uninitialized (``init_weights=False``): the
# way to start a big model that is about to be filled from a checkpoint.
def build_layout(device, dp, tp, empty=False):
    mesh = make_mesh(dp=dp, tp=tp, device_type=device.type)
    if empty:
        with schedlang.init_empty_weights():
            model = LlamaForCausalLM(tiny_config())
    else:
        model = tiny_llama(device)
    sch = schedlang.create_schedule(model, mesh=mesh)
    if tp > 1:
        shard_model(sch)
    if dp > 1:
        for i in range(tiny_config().num_hidden_layers):
            sch[f"model.layers.{i}"].fully_shard(mp_policy="fp32")
        sch.fully_shard(mp_policy="fp32")
    model, opt = schedlang.build(sch, optimizer=torch.optim.AdamW, lr=LR, device=device,
                                 **({"init_weights": False} if empty else {}))
    return model, opt, mesh


def rows_of(mesh, ids, labels):
    """This rank's rows of the global batch: its part along ``dp``, shared along ``tp``."""
    dp = mesh["dp"].size()
    d = mesh.get_local_rank("dp")
    n = ids.shape[0] // dp
    return ids[d * n:(d + 1) * n], labels[d * n:(d + 1) * n]


def run_layout(device, dp, tp, ids, labels, steps):
    model, opt, mesh = build_layout(device, dp, tp)
    tp_group = mesh["tp"].get_group()
    losses = train(model, opt, *rows_of(mesh, ids, labels), steps, tp_group)
    return model, opt, mesh, losses


def one_process_reference(device, ids, labels, steps):
    """Every rank trains the whole model on the whole batch by itself: the losses all layouts must match."""
    model = tiny_llama(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        loss = loss_of(model, ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def resume(device, dp, tp, ids, labels, checkpoint, reference, title):
    """A fresh, empty model under another layout, filled from the checkpoint; one more step."""
    model, opt, mesh = build_layout(device, dp, tp, empty=True)
    info = schedlang.load_checkpoint(checkpoint, model, opt)
    loss = train(model, opt, *rows_of(mesh, ids, labels), 1, mesh["tp"].get_group())[0]
    say(f"{title}: loaded step {info['step']} under {describe_mesh(mesh)}; step {info['step'] + 1} loss {loss:.5f} "
        f"(one process: {reference[info['step']]:.5f})")
    torch.testing.assert_close(loss, reference[info["step"]], rtol=1e-4, atol=1e-4)
    return loss


# %%
# One process, FSDP2, tensor parallelism
# ----------------------------------------
# The reference trains ``STEPS + 1`` steps alone. FSDP2 over all the ranks and tensor
# parallelism over all the ranks each train ``STEPS`` steps; their global losses match the
# reference's. The FSDP2 run then saves a checkpoint (weights and AdamW state, each rank its
# own shards), which a tensor-parallel model, built empty, loads and trains one step further:
# its loss is the reference's next one.
def one_dimensional(rank, world):
    device = device_of_rank()
    ids, labels = global_batch(device)
    # the checkpoint's directory: made by rank 0, named to all (the launching process removes it at the end)
    where = [tempfile.mkdtemp(prefix="schedlang-06-") if rank == 0 else None]
    dist.broadcast_object_list(where)
    checkpoint = os.path.join(where[0], "step")
    reference = one_process_reference(device, ids, labels, STEPS + 1)
    say(f"{world} ranks; global batch {ROWS} x {SEQ}\n")
    say(f"{'one process':34s} losses {', '.join(f'{x:.5f}' for x in reference[:STEPS])}, then {reference[STEPS]:.5f}")
    curves = {"one process": reference}

    model, opt, mesh, losses = run_layout(device, world, 1, ids, labels, STEPS)
    report(f"FSDP2 ({describe_mesh(mesh)})", losses, reference)
    curves[f"FSDP2 ({describe_mesh(mesh)})"] = losses
    show_parameters(model, "FSDP2: each rank holds 1/dp of the rows of every tensor")
    schedlang.save_checkpoint(checkpoint, model, opt, step=STEPS)
    say(f"  saved a checkpoint of step {STEPS} under FSDP2")

    model, opt, mesh, losses = run_layout(device, 1, world, ids, labels, STEPS)
    report(f"TP ({describe_mesh(mesh)})", losses, reference)
    show_parameters(model, "TP: heads, MLP columns and vocabulary split; norms replicated")

    resumed = resume(device, 1, world, ids, labels, checkpoint, reference, "\nFSDP2 checkpoint -> TP")
    curves[f"TP ({describe_mesh(mesh)}), then from the FSDP2 checkpoint"] = losses + [resumed]
    return curves, where[0]


WORLD = int(os.environ.get("WORLD_SIZE", 2))  # under torchrun, all its ranks; else two local ones
curves, checkpoint_dir = schedlang.launch(one_dimensional, world_size=WORLD)[0]

# %%
# Every layout's global loss lies on the one-process curve, and so does the step the
# tensor-parallel model trained after loading the FSDP2 checkpoint.
fig, ax = plt.subplots(figsize=(6.5, 3.4))
styles = {"one process": dict(color="0.6", linewidth=5, marker="o")}
for i, (name, losses) in enumerate(curves.items()):
    ax.plot(range(len(losses)), losses, label=name,
            **styles.get(name, dict(linestyle="--", marker="x+."[i % 3], color=f"C{i}")))
ax.axvline(STEPS - 0.5, color="0.8", linewidth=1)
ax.text(STEPS - 0.45, max(curves["one process"]), "after the checkpoint", va="top", color="0.4", fontsize=8)
ax.set_xticks(range(STEPS + 1))
ax.set_xlabel("training step")
ax.set_ylabel("global loss")
ax.set_title(f"FSDP2 and tensor parallelism on {WORLD} ranks against one process")
low, high = min(min(c) for c in curves.values()), max(max(c) for c in curves.values())
ax.set_ylim(low - 0.6 * (high - low), high + 0.05 * (high - low))  # room for the legend under the curves
ax.legend(fontsize=8, loc="lower left")
fig.tight_layout()
plt.show()

# %%
# DDP over master weights
# -----------------------
# On a model this size every rank can hold all the weights, and DDP beats FSDP2: one all-reduce
# of the gradients, running in buckets while the backward still computes, instead of gathering
# every layer's weights twice a step. With ``master_weights=True`` the fused AdamW keeps each Linear
# weight's fp32 master and the model computes with its bf16 copy, so no step casts weights or
# gradients; ``replicate`` then runs on DDP over those plain bf16 tensors, and sums their gradient
# buckets in fp32 (the ``mp_policy``'s ``reduce_dtype``, fp32 unless asked otherwise). The
# reference is one process training the whole batch with master weights: the two differ only by
# where the bf16 gradients are rounded (each rank's half, or the whole batch's), a few parts in
# ten thousand.
def ddp_master_weights(rank, world):
    device = device_of_rank()
    ids, labels = global_batch(device)
    alone, opt = schedlang.build(schedlang.create_schedule(tiny_llama(device)), optimizer="adamw", lr=LR,
                                 master_weights=True)
    # every rank trains the whole batch alone: the same losses on all of them
    reference = train(alone, opt, ids, labels, STEPS, autocast_dtype=torch.bfloat16)
    mesh = make_mesh(dp=dist.get_world_size(), device_type=device.type)
    sch = schedlang.create_schedule(tiny_llama(device), mesh=mesh)
    sch.replicate()
    model, opt = schedlang.build(sch, optimizer="adamw", lr=LR, master_weights=True)
    losses = train(model, opt, *rows_of(mesh, ids, labels), STEPS, autocast_dtype=torch.bfloat16)
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    say(f"\n{'DDP, master weights (' + describe_mesh(mesh) + ')':34s} losses {', '.join(f'{x:.5f}' for x in losses)}"
        f"   (max difference to one process {diff:.1e})")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=2e-3, atol=0)
    weight = model.model.layers[0].mlp.down_proj.weight
    master = opt.masters()[weight]
    say(f"  model.layers.0.mlp.down_proj.weight: a plain {weight.dtype} tensor of shape {tuple(weight.shape)}; "
        f"its master in the optimizer is {master.dtype}")


schedlang.launch(ddp_master_weights, world_size=WORLD)



# %%
# A 2-D mesh
# ----------
# On four ranks, ``dp=2 x tp=2``: two tensor-parallel groups of two ranks, each group training
# on half of the batch, every parameter split along ``tp`` by the schedule and along ``dp`` by
# FSDP2. A tensor-parallel shard that FSDP2 splits again is a DTensor with two placements, one
# per mesh dimension. The checkpoint saved under FSDP2 on two ranks loads here as well.
def two_dimensional(rank, world, checkpoint):
    device = device_of_rank()
    ids, labels = global_batch(device)
    reference = one_process_reference(device, ids, labels, STEPS + 1)
    say(f"{world} ranks")
    model, opt, mesh, losses = run_layout(device, 2, world // 2, ids, labels, STEPS)
    report(f"2-D ({describe_mesh(mesh)})", losses, reference)
    show_parameters(model, "2-D: split along tp by the schedule, then along dp by FSDP2")
    resume(device, 2, world // 2, ids, labels, checkpoint, reference, "FSDP2 checkpoint -> 2-D")


# the 2-D mesh takes four local ranks, or torchrun's if it started four or more (an even number)
if "RANK" not in os.environ or (WORLD >= 4 and WORLD % 2 == 0):
    schedlang.launch(two_dimensional, world_size=WORLD if "RANK" in os.environ else 4,
                     args=(os.path.join(checkpoint_dir, "step"),))
else:
    say(f"\n(the 2-D mesh needs 4 ranks or more, an even number; this run has {WORLD})")
shutil.rmtree(checkpoint_dir, ignore_errors=True)



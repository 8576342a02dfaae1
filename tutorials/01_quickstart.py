"""
Quick start: schedule, verify and build a model
===============================================

A schedule says *how* to run a model without editing it. This tutorial wraps a small
MLP, makes it tensor parallel the Megatron way, checks the result against the original
model (forward and backward), prints and saves the plan, and builds the model.

It runs as a plain script on one CPU process; launched with
``torchrun --nproc_per_node=2 tutorials/01_quickstart.py`` the same lines shard the MLP
over two ranks.
"""

# %%
# The model
# ---------
# Ordinary PyTorch: schedlang never needs the model's source to change.

import os

import torch
import torch.distributed as dist
import torch.nn as nn

import schedlang

if "RANK" in os.environ and not dist.is_initialized():  # under torchrun
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


class MLP(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.linear1 = nn.Linear(hidden, 4 * hidden)
        self.activation = nn.GELU()
        self.linear2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.linear2(self.activation(self.linear1(x)))


torch.manual_seed(0)
model = MLP()

# %%
# A schedule mirrors the module tree
# ----------------------------------
# ``sch["linear1"]`` is the schedule of ``model.linear1``. The schedule works on its own
# copy of the model: ``model`` itself is never changed.

sch = schedlang.create_schedule(model)
print(sch.mod)
print("children:", list(sch.child), "| world size:", sch.world_size)

# %%
# Tensor parallelism, verified
# ----------------------------
# Split ``linear1`` by output features (column parallel) and ``linear2`` by input features
# (row parallel). Each rank then holds a partial sum after ``linear2``: an all-reduce in
# forward completes it, and an all-reduce of the input gradient in backward does the same
# for ``linear1``. ``Verify`` runs the original and the scheduled model on the same inputs
# and weights when the block ends and compares outputs and all gradients; with one process
# the collectives are no-ops and the check still runs.

x = torch.randn(8, 64)
with schedlang.Verify(sch, example_inputs=[x]) as check:
    sch["linear1"].shard("weight", axis=0)
    sch["linear1"].shard("bias", axis=0)
    sch["linear2"].shard("weight", axis=1)
    sch["linear2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["linear1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
print(check.report)

# %%
# Mistakes are caught, with the step that caused them
# ---------------------------------------------------
# Replacing the activation by one that differs is reported, naming the output that
# differs and the steps applied inside the block. A block that fails is undone: the plan
# and the schedule's model are as they were before it.

try:
    with schedlang.Verify(sch, example_inputs=[x]):
        sch["activation"].replace(nn.ReLU())
except schedlang.VerificationError as err:
    print(str(err).splitlines()[0])
    print(str(err).splitlines()[1][:100], "...")
print("after the failed block:", len(sch.plan), "steps; the activation is still", type(sch["activation"].mod).__name__)

# %%
# Bad arguments are refused before anything changes:

try:
    sch["linear1"].shard("weight", axis=5)
except schedlang.ShardError as err:
    print(err)

# %%
# The plan
# --------
# Every call is a step of ``sch.plan``: the five verified steps above, and one more added
# here. The plan prints, saves as JSON and replays on a fresh instance of the model.

sch["linear1"].decompose()
print(sch.plan)
text = sch.plan.to_json()
again = schedlang.replay(text, MLP())
print("replayed", len(again.plan), "steps; linear1 is now", type(again["linear1"].mod).__name__)

# %%
# Build
# -----
# ``build`` returns the model to train and, if asked, an optimizer.

built, optimizer = schedlang.build(sch, optimizer=torch.optim.AdamW, lr=1e-3)
loss = built(x).pow(2).mean()
loss.backward()
optimizer.step()
print(f"one training step done, loss {loss.item():.4f}")

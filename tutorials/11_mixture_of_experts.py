"""
Mixture of experts: spreading the experts
=========================================

A mixture-of-experts block holds many expert MLPs and sends each token to a few of them (its top-k,
chosen by a router). The experts hold most of the weights but each token uses only k of them, so
splitting every expert over the ranks (tensor parallelism) makes every rank touch every expert for
every token. Expert parallelism spreads the experts themselves: each rank keeps ``E / ep`` whole
experts and runs its own batch; in every block the tokens travel to the ranks holding their experts
and back by an all-to-all.

This tutorial

* spreads a tiny Qwen3-MoE's experts over two ranks with one primitive, ``sch.expert_parallel()``,
  checked by ``schedlang.Verify``;
* checks that one training step of the two ranks, each on its own batch, equals one process stepping on
  the mean of both batches' losses;
* trains a few steps and plots how many tokens each expert received (``tokens_per_expert``): the load
  of each expert's rank, which the router's auxiliary loss pushes towards even.

Run it as a plain script on CPU (two gloo ranks)::

    python tutorials/11_mixture_of_experts.py
"""

# %%
# The model and the split
# -----------------------
# transformers keeps a block's experts as two 3-D tensors (``gate_up_proj`` [E, 2I, H] and ``down_proj``
# [E, H, I]). ``expert_parallel`` replaces each block's experts module with one that holds this rank's
# slice of those tensors (rank ``r`` of ``ep`` keeps experts ``r E/ep .. (r+1) E/ep - 1``), sorts each
# token's choices by expert, exchanges the counts, sends the rows to their experts' ranks, runs the
# family's own expert forward on them, and sends the results back, where they are weighted and summed.
# The router, its top-k and the auxiliary load-balancing loss stay as the family wrote them. Nothing is
# dropped: there is no capacity limit.

import copy

import matplotlib

matplotlib.use("Agg")  # no display needed: the gallery and CI render to files
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

import schedlang  # noqa: E402
from schedlang.distributed.expert_parallel import ExpertParallelExperts, expert_parameters, reduce_gradients  # noqa: E402

EXPERTS = 8
VOCAB = 128
STEPS = 12
LR = 0.3


def tiny_moe():
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=12, intermediate_size=96, moe_intermediate_size=24,
                            num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=True,
                            output_router_logits=True, router_aux_loss_coef=0.1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # a skewed random router, so that the load starts uneven
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    return model


def batch(rank, step):
    """Rank ``rank``'s token ids at ``step``: two sequences whose length differs by rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, 20 + 4 * rank), generator=g)


# %%
# One step on two ranks against one process
# -----------------------------------------
# Each rank runs its own batch. After backward, a rank's expert slices hold the gradient of the *sum* of
# both ranks' losses (every token that chose an expert sent its gradient back to the expert's rank); all
# other parameters (attention, router) hold the gradient of this rank's loss only. ``reduce_gradients``
# does the data-parallel reduction that follows from that: it sums the other gradients over the ranks,
# leaves the expert slices alone (their ranks hold different experts), and divides both by the number of
# ranks, giving the gradient of the mean loss. ``Verify`` checks the split first, forward and backward,
# with each rank's tokens its own and each expert slice's gradient against the original's summed over
# the group.


def step_and_load(rank, world, steps):
    original = tiny_moe()
    reference = copy.deepcopy(original)  # one process, both ranks' batches
    sch = schedlang.create_schedule(original)
    with schedlang.Verify(sch, example_inputs=[batch(0, 0)]):
        sch.expert_parallel()
    model = sch.mod
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)

    # one step each way
    ref_opt.zero_grad()
    (sum(reference(b, labels=b).loss for b in (batch(r, 0) for r in range(world))) / world).backward()
    ref_opt.step()
    tokens = batch(rank, 0)
    model(tokens, labels=tokens).loss.backward()
    reduce_gradients(model)
    opt.step()
    opt.zero_grad()
    full = dict(reference.named_parameters())
    spread = expert_parameters(model)
    difference = 0.0
    for name, p in model.named_parameters():
        want = full[name].detach()
        if name in spread:  # this rank's experts
            local = p.shape[0]
            want = want[rank * local:(rank + 1) * local]
        difference = max(difference, float((p.detach() - want).abs().max()))

    # a few more steps, reading each block's tokens per local expert after every forward
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    loads, losses = [], []
    tokens = batch(rank, 1)  # the same batch every step: the loss falls as the model learns it
    for step in range(1, steps + 1):
        loss = model(tokens, labels=tokens).loss
        loads.append([block.tokens_per_expert.tolist() for block in blocks])  # [layer][local expert]
        loss.backward()
        reduce_gradients(model)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return {"difference": difference, "experts": [blocks[0].ep_rank * blocks[0].local_experts,
                                                  (blocks[0].ep_rank + 1) * blocks[0].local_experts - 1],
            "loads": loads, "losses": losses}


results = schedlang.launch(step_and_load, world_size=2, args=(STEPS,))
for rank, r in enumerate(results):
    print(f"rank {rank}: experts {r['experts'][0]}..{r['experts'][1]}; after one step, largest difference from "
          f"one process's weights {r['difference']:.1e}")

# %%
# Tokens per expert
# -----------------
# Each rank's ``tokens_per_expert`` counts the (token, choice) rows its local experts received from both
# ranks; put side by side, the ranks' counts give the load of every expert. Every token makes two
# choices, so each layer's counts add up to twice the tokens of both batches.

load = [[sum((r["loads"][step][layer] for r in results), []) for layer in range(2)] for step in range(STEPS)]
for step in (0, STEPS - 1):
    for layer in range(2):
        counts = load[step][layer]
        print(f"step {step + 1:2d}, layer {layer}: tokens per expert {counts} (sum {sum(counts)}, "
              f"busiest / mean {max(counts) / (sum(counts) / EXPERTS):.2f})")
print("mean loss by step:", " ".join(f"{x:.3f}" for x in results[0]["losses"]))

fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
width = 0.4
for layer, ax in enumerate(axes[:2]):
    xs = range(EXPERTS)
    ax.bar([x - width / 2 for x in xs], load[0][layer], width, label="step 1")
    ax.bar([x + width / 2 for x in xs], load[-1][layer], width, label=f"step {STEPS}")
    ax.axvline(EXPERTS / 2 - 0.5, color="grey", linestyle="--", linewidth=1)
    ax.text(0.25, 0.92, "rank 0", transform=ax.transAxes, ha="center", color="grey")
    ax.text(0.75, 0.92, "rank 1", transform=ax.transAxes, ha="center", color="grey")
    ax.set_title(f"layer {layer}: tokens per expert")
    ax.set_xlabel("expert")
    ax.set_xticks(list(xs))
    ax.legend(fontsize=8, loc="lower right")
axes[0].set_ylabel("rows received")
for layer in range(2):
    imbalance = [max(step[layer]) / (sum(step[layer]) / EXPERTS) for step in load]
    axes[2].plot(range(1, STEPS + 1), imbalance, marker="o", label=f"layer {layer}")
axes[2].axhline(1.0, color="grey", linestyle="--", linewidth=1)
axes[2].set_title("busiest expert / mean, by step")
axes[2].set_xlabel("step")
axes[2].legend(fontsize=8)
fig.tight_layout()

# %%
# Where it goes from here
# -----------------------
# ``sch.expert_parallel("dp")`` spreads the experts over a dimension of the schedule's mesh instead of
# the world; with data-parallel ranks outside the expert-parallel group, pass ``reduce_gradients`` the
# group of ranks holding the same experts (``replica_group``). The local experts run one after another
# with the family's own forward (no grouped GEMM yet). See :doc:`/guide/parallelism` for the gradient
# contract, and :doc:`/families` for the families it applies to.

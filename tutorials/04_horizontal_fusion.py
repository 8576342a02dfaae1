"""
Horizontal fusion with atomic rules
===================================

Recommendation and ranking models often apply the same small computation to many
features side by side: N layer norms over the N slices of an embedding output, N parallel
``Linear -> LayerNorm -> ReLU`` towers. Each of those ops is one GPU kernel launch that
does almost no work, so the model spends its time launching kernels.

``sch.horizontal_fuse()`` rewrites such a traced module with a handful of *atomic rules*,
each doing one small step (fuse the layer norms, fuse the activations, remove a
``split``/``cat`` round trip ...), applied until nothing changes. Chained, they turn N-wide
computations into one op each. This tutorial runs the two cases of the PyTorch blog posts
on atomic horizontal-fusion rules end to end, prints the graphs before and after, and
checks the numerics, forward and backward. It runs on a CPU in a few seconds.
"""

# %%
# Case 1: split -> LayerNorm -> tanh -> cat
# -----------------------------------------
# An embedding output of shape ``(B, N*D)`` is cut into N features of width D; each gets
# its own LayerNorm and a tanh; the results are concatenated again (2N + 2 kernels).

import torch
import torch.nn as nn

import schedlang


class FeatureNorms(nn.Module):
    def __init__(self, n: int = 6, d: int = 8):
        super().__init__()
        self.d = d
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))

    def forward(self, x):
        pieces = x.split(self.d, -1)
        return torch.cat([torch.tanh(norm(pieces[i])) for i, norm in enumerate(self.norms)], -1)


torch.manual_seed(0)
model = FeatureNorms()
with torch.no_grad():  # random affine parameters, so that a mix-up between features would show
    for p in model.parameters():
        p.normal_(1.0 if p.dim() == 1 else 0.0, 0.5)

sch = schedlang.create_schedule(model)
sch.trace()
print(sch.mod.code)

# %%
# Fuse. The report says which rule rewrote which nodes, and which new parameters were
# made: the six LayerNorm weights are stacked into one ``(6, 8)`` parameter (and the
# biases likewise), initialized from the originals.

report = sch.horizontal_fuse()
print(report)

# %%
# The graph is now: view ``(B, N*D)`` as ``(B, N, D)``, one layer norm over the last dim
# with the stacked affine parameters, one tanh, and a view back. (The ``narrow`` is a
# free view: with ``x.split(8)`` the tracer cannot know there are exactly six pieces.)

print(sch.mod.code)

# %%
# Here the layer norms normalize the split dim, so the last piece must be whole. When that
# does not follow from the graph (``torch.split(x, D, dim=1)``: the graph has no shapes,
# so dim 1 need not be the last dim), every branch is fused all the same: the layer norms
# become one ``piecewise_layer_norm``, which checks the length of ``x`` at run time and
# takes the grouped path when all N pieces are whole, else normalizes each piece as the
# original did. ``sch.horizontal_fuse(example_inputs=[x])`` gives the rules every shape
# instead (the graph runs once on fake tensors), and then no check is needed.
#
# Same outputs, same gradients. A gradient of a stacked parameter holds the gradients of
# the originals: slice ``i`` belongs to ``norms[i]``.

x = torch.randn(32, 48)
x_ref, x_new = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
g = torch.randn(32, 48)
model(x_ref).backward(g)
out = sch.mod(x_new)
out.backward(g)
torch.testing.assert_close(out, model(x))
torch.testing.assert_close(x_new.grad, x_ref.grad)

from schedlang.graph.passes.horizontal import RULES, fused_parameter_sources  # noqa: E402

originals = dict(model.named_parameters())
for name, info in fused_parameter_sources(sch.mod).items():
    fused_grad = getattr(sch.mod, name).grad
    for source in info.sources:
        torch.testing.assert_close(source.take(fused_grad), originals[source.name].grad)
print("outputs, input gradients and all", len(originals), "parameter gradients match")

# %%
# Case 2: parallel MLP towers
# ---------------------------
# Four ``Linear -> LayerNorm -> ReLU`` towers read the same input. The rule
# ``linear_same_input`` makes one GEMM on the concatenated weights; the layer norm and
# activation rules then work on its pieces.


class Towers(nn.Module):
    def __init__(self, n: int = 4, d_in: int = 16, d: int = 8):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(d_in, d) for _ in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))

    def forward(self, x):
        return torch.cat([torch.relu(norm(lin(x))) for lin, norm in zip(self.linears, self.norms)], -1)


towers = Towers()
sch2 = schedlang.create_schedule(towers)
sch2.trace()
print(sch2.mod.code)
print(sch2.horizontal_fuse())
print(sch2.mod.code)

x = torch.randn(5, 16)
torch.testing.assert_close(sch2.mod(x), towers(x))

# %%
# Kernels launched, before and after
# ----------------------------------
# On a GPU every ATen operation a forward runs is (at least) one kernel launch, except views, which
# only relabel memory. A ``TorchDispatchMode`` sees each operation as it runs, so counting them on
# the CPU counts the launches a GPU would make. Both cases go from a few launches per feature to a
# handful in all, whatever N is.

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # no display needed: the gallery and CI render to files
import matplotlib.pyplot as plt  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class CountLaunches(TorchDispatchMode):
    """Records the ATen operations run under it, views left out."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def launches(module, *inputs):
    with torch.no_grad(), CountLaunches() as counter:
        module(*inputs)
    return counter.ops


cases = {"split -> LayerNorm -> tanh -> cat\n(N = 6)": (model, sch.mod, torch.randn(32, 48)),
         "Linear -> LayerNorm -> ReLU towers\n(N = 4)": (towers, sch2.mod, torch.randn(5, 16))}
counts = {}
for case, (eager, fused, example) in cases.items():
    before, after = launches(eager, example), launches(fused, example)
    counts[case] = (len(before), len(after))
    assert len(after) < len(before)
    print(f"{case.splitlines()[0]}: {len(before)} launches before, {len(after)} after: {', '.join(after)}")

fig, ax = plt.subplots(figsize=(6.5, 3))
rows = range(len(counts))
ax.barh([r + 0.2 for r in rows], [b for b, _ in counts.values()], height=0.4, color="tab:gray", label="eager")
ax.barh([r - 0.2 for r in rows], [a for _, a in counts.values()], height=0.4, color="tab:orange",
        label="after horizontal_fuse()")
ax.set_yticks(list(rows), list(counts))
ax.invert_yaxis()
ax.set_xlabel("kernel launches per forward (non-view ATen ops)")
ax.set_xlim(0, 1.5 * max(before for before, _ in counts.values()))  # room for the legend
ax.legend(fontsize=8, loc="center right")
ax.tick_params(labelsize=8)
fig.tight_layout()
plt.show()

# %%
# Dependent ops are never fused
# -----------------------------
# Candidates are grouped in two steps: by a rule key (here: same input shape and
# features), then into sets with no data dependency between members. A chain
# ``l2(l1(x))`` of equal-shape linears has nothing to fuse: each needs the previous one.
# (Shapes let the rules compare inputs that are not pieces of one split: recorded by
# ``ShapeProp`` as below, or given as ``horizontal_fuse(example_inputs=[...])``.)

from torch.fx.passes.shape_prop import ShapeProp  # noqa: E402


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        return self.l2(self.l1(x)), self.l3(y)


chain = Chain()
gm = torch.fx.symbolic_trace(chain)
ShapeProp(gm).propagate(torch.randn(4, 8), torch.randn(4, 8))
sch3 = schedlang.create_schedule(gm)
print(sch3.horizontal_fuse())  # l1 and l3 become one batched matmul; l2 stays

# %%
# Choosing rules, and replaying
# -----------------------------
# ``rules=[...]`` restricts the rewrite to some rules; ``min_group_size`` skips small
# groups. The arguments are plain data, so the plan is JSON and replays on a fresh model.

print(list(RULES))  # in the order a sweep applies them
print(sch.plan)
again = schedlang.replay(sch.plan.to_json(), model)
torch.testing.assert_close(again.mod(x_ref.detach()), model(x_ref.detach()))

# %%
# Related: many sparse features, and communication
# ------------------------------------------------
# The same posts also combine a model's N sparse inputs ``(indices, lengths)`` into one
# pair (2 host-to-device copies instead of 2N: ``schedlang.sparse.combine_sparse_features``
# with the ``combine_sparse_features`` primitive), and overlap collectives with independent
# computation (the ``overlap_communication`` primitive).

# %%
# On a GPU
# --------
# ``bench/bench_horizontal.py`` times the fused models against eager PyTorch,
# ``torch.compile`` and the hand-written rewrite; ``bench/results/*horizontal*.md`` holds
# the figures (split-LN-tanh-cat with N=50 features of width 64 on a batch of 2048, and 32
# parallel 256->64 linears in bf16).

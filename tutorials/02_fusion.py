"""
Operator fusion: trace, find, fuse
==================================

Elementwise chains such as *bias add + GELU* or *dropout + residual add + LayerNorm*
read and write the whole activation once per operation. Fusing each chain into one
kernel moves it through memory once. This tutorial

* traces only the submodule it optimizes, into an FX graph,
* finds the chains with pattern functions matched by dataflow,
* fuses them into generated Triton kernels (and shows the kernel source),
* checks outputs and gradients against the original model, and replays the plan.

On a machine without a GPU the kernels run in Triton's interpreter (slow, but exact).
"""

# %%
# Setup
# -----
# Triton reads ``TRITON_INTERPRET`` when it is imported, so it is set first when there is no
# GPU. ``import schedlang`` does not import Triton; the first ``fuse(..., "triton")`` does.

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn as nn
import torch.nn.functional as F

import schedlang

device = "cuda" if torch.cuda.is_available() else "cpu"


class MLP(nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.linear1 = nn.Linear(hidden, 4 * hidden)
        self.activation = nn.GELU()
        self.linear2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.linear2(self.activation(self.linear1(x)))


class Projection(nn.Module):
    """Attention output: dense -> dropout -> + residual -> LayerNorm."""

    def __init__(self, hidden=64):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(0.1)
        self.layer_norm = nn.LayerNorm(hidden)

    def forward(self, hidden_states, residual):
        return self.layer_norm(self.dropout(self.dense(hidden_states)) + residual)


class Block(nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.proj = Projection(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x):
        return self.mlp(self.proj(x, x))


torch.manual_seed(0)
model = Block().to(device).eval()
sch = schedlang.create_schedule(model)

# %%
# Bias + GELU
# -----------
# ``nn.Linear`` adds its bias inside one GEMM call, so there is no separate bias add to fuse.
# ``decompose()`` splits it into ``linear(x, weight)`` and ``+ bias``. Then only the MLP is
# traced: ``flatten=True`` puts the decomposed linear's operations into the MLP's graph.

sch["mlp.linear1"].decompose()
sch["mlp"].trace(flatten=True)
print(sch["mlp"].mod.code)

# %%
# A pattern is a plain function. It matches by dataflow: ``bias + x`` also matches
# ``x + bias``, and ``F.gelu`` matches the ``nn.GELU`` module the model calls. The result
# is a list of subgraphs, each a list of ``(path, node)``.


def bias_gelu(x, bias):
    return F.gelu(bias + x)


subgraphs = sch["mlp"].find(bias_gelu)
print(subgraphs)

# %%
# ``fuse`` lowers each subgraph to one module. The ``linear1.bias`` parameter stays where
# it was (a graph input of the fused module), so sharding, the optimizer and the state dict
# see the same tensor. The generated source holds a forward and a backward kernel.

sch["mlp"].fuse(subgraphs, compiler="triton", name="BiasGeLU")
print(sch["mlp"].mod)
x = torch.randn(4, 16, 64, device=device)
sch.mod(x)  # the first call specializes the kernels to the input's dtype and shape
print(sch["mlp.BiasGeLU_0"].mod.source)

# %%
# Dropout + residual + LayerNorm
# ------------------------------
# The same steps on the projection. The LayerNorm's weight and bias, like the dense bias,
# remain parameters of the model and are passed to the kernel.

sch["proj.dense"].decompose()
sch["proj"].trace(flatten=True)


def ln_chain(x, bias, residual):
    return F.layer_norm(F.dropout(x + bias) + residual, (64,))


found = sch["proj"].find(ln_chain)
print(found)
sch["proj"].fuse(found, compiler="triton", name="FusedLayerNorm")
sch.mod(x)


def forward_kernel(source: str) -> str:
    """The forward kernel of a generated source (it also holds helpers and the backward)."""
    return next("@triton.jit" + part for part in source.split("@triton.jit") if "_fwd_kernel(" in part)


print(forward_kernel(sch["proj.FusedLayerNorm_0"].mod.source))

# %%
# The graphs, drawn
# -----------------
# ``sch.report("report.html")`` writes one self-contained page of what the schedule did: the plan,
# the module tree, the generated kernels and, for every traced submodule, its graph as first traced
# and as it is now. Those drawings come from ``schedlang.report.graph_svg``; here are the two of the
# MLP, side by side. The fused kernel is the red node: the bias add and the GELU are gone, and the
# bias reaches the kernel as an input.

import html  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402

from schedlang.report import collect, graph_svg  # noqa: E402


class SideBySide:
    """SVG drawings next to each other, each under its caption.

    Jupyter, and this gallery, show the object a cell ends with through its ``_repr_svg_``; a plain
    script shows nothing, so the cell prints what was drawn as well.
    """

    def __init__(self, drawings):
        self.drawings = drawings  # caption -> <svg> element

    def _repr_svg_(self):
        parts, x, height = [], 0.0, 0.0
        for caption, svg in self.drawings.items():
            width, h = (float(re.search(f'{key}="([0-9.]+)"', svg).group(1)) for key in ("width", "height"))
            parts.append(f'<text x="{x + 12:.0f}" y="16" font-size="13" font-family="sans-serif">'
                         f'{html.escape(caption)}</text>')
            parts.append(svg.replace("<svg ", f'<svg x="{x:.0f}" y="24" ', 1))
            x, height = x + width, max(height, h + 24)
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{x:.0f}" height="{height:.0f}" '
                f'viewBox="0 0 {x:.0f} {height:.0f}">' + "".join(parts) + "</svg>")


report_file = sch.report(os.path.join(tempfile.mkdtemp(prefix="schedlang-"), "report.html"))
print("the whole report:", report_file)
mlp_graphs = next(g for g in collect(sch).graphs if g["path"] == "mlp")
print(f"mlp: {len(mlp_graphs['before'])} nodes as traced, {len(mlp_graphs['after'])} now")
SideBySide({"mlp as traced": graph_svg(mlp_graphs["before"]), "after fusion": graph_svg(mlp_graphs["after"])})

# %%
# Same numbers, forward and backward
# ----------------------------------
# ``Verify`` replays the plan on a fresh copy and compares outputs, input gradients and
# every parameter gradient with the original model in eval mode. It compares training mode
# too, with dropout on under the same seed, when both models draw the same random numbers.
# Here they do not: the fused kernel draws its dropout mask itself. Verify says so, and the
# comparison covers eval mode: the output, the input gradient and the 8 parameter gradients.

check = schedlang.create_schedule(model)
with schedlang.Verify(check, example_inputs=[torch.randn(3, 7, 64, device=device)]) as verify:
    schedlang.plan.apply_steps(check, sch.plan)
print("verified:", verify.report.passed, "-", len(verify.report.compared), "tensors compared")

# %%
# The plan
# --------
# ``find`` is a query, not a step; the plan records the subgraphs by node name, so it
# replays on a fresh model (on every rank, or from JSON).

print(sch.plan)
replayed = schedlang.replay(sch.plan.to_json(), Block().to(device).eval())
print(replayed["mlp"].mod.code)

# %%
# Other compilers
# ---------------
# ``compiler="inductor"`` hands the subgraph to ``torch.compile`` (any PyTorch op) and
# ``compiler="eager"`` runs it op by op, which helps to tell a fusion bug from a kernel bug.

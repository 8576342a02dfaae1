"""
Fused multi-tensor optimizers
=============================

``torch.optim.AdamW`` with its default (foreach) implementation reads and writes every
parameter once per elementwise operation, about a dozen times per step. ``schedlang.optim``
provides ``FusedAdamW``, ``FusedAdam`` and ``FusedSGD``: each step is one Triton launch per
parameter group (and a tiny one for the step counters) that reads parameter, gradient and state
once and writes them once, the least memory traffic an optimizer step can have.

They are ``torch.optim.Optimizer`` subclasses with torch.optim's arguments and state-dict
layout, so swapping them in is a one-line change. This tutorial swaps the optimizer of a small
model, checks that training follows torch.optim step for step, and shows the GPU timings.
"""

# %%
# Setup
# -----
# On a machine without a GPU the Triton kernels run under Triton's interpreter. The variable must
# be set before the kernels are first used (schedlang imports Triton lazily, at the first step).
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import schedlang.optim  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 10)
    ).to(device)


# %%
# Swap the optimizer
# ------------------
# Two identical models: one trained with ``torch.optim.AdamW``, one with
# ``schedlang.optim.FusedAdamW`` and the same arguments. The learning rate of the fused one is a
# tensor on the device: the kernel reads it there, so a scheduler changing it costs no
# recompilation and no host synchronization (and works inside a captured CUDA graph).
reference_model, fused_model = make_model(), make_model()
reference_opt = torch.optim.AdamW(reference_model.parameters(), lr=1e-2, weight_decay=0.1)
fused_opt = schedlang.optim.FusedAdamW(
    fused_model.parameters(), lr=torch.tensor(1e-2, device=device), weight_decay=0.1
)
schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5) for o in (reference_opt, fused_opt)]

x = torch.randn(64, 32, device=device)
y = torch.randint(0, 10, (64,), device=device)
times = {"torch.optim.AdamW": [], "schedlang FusedAdamW": []}
for step in range(10):
    for name, model, opt in (("torch.optim.AdamW", reference_model, reference_opt),
                             ("schedlang FusedAdamW", fused_model, fused_opt)):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times[name].append(time.perf_counter() - start)
    for s in schedulers:
        s.step()

# %%
# Check: the two models are the same
# ----------------------------------
# Same parameters after 10 steps (fp32 tolerances), same state under the same keys.
for (name, p), q in zip(reference_model.named_parameters(), fused_model.parameters()):
    torch.testing.assert_close(q, p)
    print(f"{name:10s} max |difference| = {(q - p).abs().max().item():.2e}")
print("state keys:", sorted(fused_opt.state[next(fused_model.parameters())]))
print("learning rate now:", float(fused_opt.param_groups[0]["lr"]))

# %%
# The state dict is torch.optim's: it loads into ``torch.optim.AdamW`` and back.
restored = torch.optim.AdamW(make_model().parameters(), lr=1e-2, weight_decay=0.1)
restored.load_state_dict(fused_opt.state_dict())
print("loaded into torch.optim.AdamW, step =", float(next(iter(restored.state.values()))["step"]))

# %%
# Step times
# ----------
# Median of the last 8 steps measured here (the first steps include compilation). On a CPU the
# kernel runs in Triton's numpy interpreter: those figures show that it works, not how fast it is.
for name, ts in times.items():
    median = sorted(ts[2:])[len(ts[2:]) // 2]
    where = device + (", Triton interpreter" if device == "cpu" and "schedlang" in name else "")
    print(f"{name:22s} {median * 1e3:8.2f} ms/step ({where})")

# %%
# On a GPU
# --------
# On a GPU the fused step runs near the memory floor. ``bench/bench_optim.py`` measures an AdamW
# step over 445 tensors with GPT-2-medium shapes (1.4 GB of fp32 parameters) against every
# torch.optim variant. Its recorded result file is read here (from the checkout: the first folder
# upwards from this file that holds ``bench/results``) and drawn as it is: median step time per
# variant, with the floor the file states (the time to read and write the optimizer's bytes once at
# the measured copy bandwidth).
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # no display needed: the gallery and CI render to files
import matplotlib.pyplot as plt  # noqa: E402

RESULT = Path("bench") / "results" / "2026-11-21-optim.md"
here = Path(globals().get("__file__", "x")).resolve().parent  # the gallery runs this without __file__
recorded = next((d / RESULT for d in (here, *here.parents) if (d / RESULT).is_file()), None)
if recorded is None:
    print(f"{RESULT} not found: run python bench/bench_optim.py on a GPU")
else:
    text = recorded.read_text()
    print(text.splitlines()[0].lstrip("# "))
    print(text.splitlines()[2])
    rows = re.findall(r"^\| ([^|]+?) \| ([0-9.]+) \| ([0-9.]+) \|", text.split("| other variants")[0], re.M)
    floor_ms = float(re.search(r"\*\*([0-9.]+) ms\*\*", text).group(1))
    for variant, ms, x_floor in rows:
        print(f"  {variant:36s} {float(ms):7.3f} ms  {float(x_floor):5.2f}x the floor")
    fig, ax = plt.subplots(figsize=(7, 0.42 * len(rows) + 1.3))
    names = [variant for variant, _, _ in rows]
    ax.barh(names, [float(ms) for _, ms, _ in rows],
            color=["tab:orange" if name.startswith("schedlang") else "tab:gray" for name in names])
    ax.axvline(floor_ms, color="black", linestyle="--", linewidth=1)
    ax.text(floor_ms, len(rows) - 0.4, f" memory floor {floor_ms:.2f} ms", fontsize=8, va="bottom")
    ax.invert_yaxis()
    ax.set_xlabel("AdamW step, median ms (lower is faster)")
    ax.set_title(text.splitlines()[0].lstrip("# ") + "\n" + text.splitlines()[2].split(";")[0], fontsize=9)
    ax.tick_params(labelsize=8)
    fig.tight_layout()
    plt.show()

# %%
# Capturing a whole step in a CUDA graph
# --------------------------------------
# Every input of the kernel lives on the device (learning rate, step counters, the tables of
# tensor addresses), so a step can be captured once and replayed; changing the learning-rate
# tensor between replays changes the update::
#
#     opt = schedlang.optim.FusedAdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"))
#     ...                                   # a few eager steps first: they create the state
#     graph = torch.cuda.CUDAGraph()
#     with torch.cuda.graph(graph):
#         opt.step()
#     opt.param_groups[0]["lr"].fill_(5e-4)
#     graph.replay()
#
# Master weights: bf16 parameters, fp32 in the optimizer
# -------------------------------------------------------
# Under bf16 autocast over fp32 weights every step casts each Linear weight to bf16 (forward) and
# each bf16 weight gradient back to fp32 (backward). With ``master_weights=True`` the optimizer
# keeps the fp32 value of each parameter of the group (the *master*) and turns the parameter into
# its bf16 rounding; its fused step updates the master and writes the rounding back, so those
# casts disappear and the numbers stay autocast's. ``master_weight_groups`` picks the weights
# autocast would cast (plain ``nn.Linear`` weights, GPT-2's ``Conv1D`` and torchao's float8 Linears,
# which then scale a bf16 weight to float8 instead of an fp32 one); the LayerNorm and the biases stay
# fp32. ``schedlang.build(sch, optimizer="adamw", master_weights=True)`` does the same. What it saves
# on a GPU is measured by ``bench/bench_train.py --optimizer schedlang-fused`` (variants
# ``schedlang-optimize-mw``, ``-fp8-mw-cg``) and shown in the README's performance table.
mw_model, autocast_model = make_model(), make_model()
groups = schedlang.optim.master_weight_groups(mw_model)
mw_opt = schedlang.optim.FusedAdamW(groups, lr=1e-2, weight_decay=0.1)
autocast_opt = torch.optim.AdamW(autocast_model.parameters(), lr=1e-2, weight_decay=0.1)
print({name: p.dtype for name, p in mw_model.named_parameters()})
for model, opt in ((mw_model, mw_opt), (autocast_model, autocast_opt)):
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    print(f"{type(opt).__name__}: loss {loss.item():.6f}")
masters = mw_opt.master_state_dict(mw_model)  # the fp32 truth, for checkpoints and exports
for name, value in autocast_model.state_dict().items():
    torch.testing.assert_close(masters[name], value, rtol=1e-5, atol=1e-6)
print("after one step the fp32 masters equal the fp32 weights trained under autocast")

# %%
# By name
# -------
# ``schedlang.build(sch, optimizer="adamw", lr=...)`` builds its optimizer with
# ``schedlang.optim.make_optimizer``:
opt = schedlang.optim.make_optimizer("sgd", make_model().parameters(), lr=0.1, momentum=0.9, nesterov=True)
print(type(opt).__name__, opt.defaults["momentum"], opt.defaults["nesterov"])

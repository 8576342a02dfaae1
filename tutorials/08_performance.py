"""
Performance at a glance
=======================

The GPU benchmarks in ``bench/`` write every measurement to ``bench/results/*.json``: one row per
variant of a work (a model, a layout), with its step time, throughput, MFU, peak memory, the check
it passed and the git revision that measured it. This tutorial draws those recorded numbers, so the
figures below are exactly what the result files say; nothing is typed in by hand, and a work with no
recorded GPU result is named as such instead of drawn.

The second half measures something live, on the CPU: the memory/speed trade-off of activation
checkpointing every n-th layer of a small LLaMA. CPU figures show the *shape* of the trade-off
(how saved activations fall and recomputation grows as more layers are checkpointed), not GPU speed.
"""

# %%
# Reading the recorded GPU results
# --------------------------------
# ``bench/render_readme.py`` already knows how to read the result files (GPU runs only) and which
# rows are the newest for each work; we import it rather than reading the files a second way.
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed: the gallery and CI render to files
import matplotlib.pyplot as plt  # noqa: E402

# The checkout holding bench/: the first folder upwards from this file that has it. The gallery runs
# tutorials without ``__file__`` from inside tutorials/, so the search then starts there.
HERE = Path(globals().get("__file__", "x")).resolve().parent
ROOT = next((d for d in (HERE, *HERE.parents) if (d / "bench" / "render_readme.py").is_file()), None)
if ROOT is None:
    raise FileNotFoundError(f"no bench/render_readme.py in {HERE} or a folder above it: run this tutorial "
                            "from a schedlang checkout")
sys.path.insert(0, str(ROOT / "bench"))
import render_readme  # noqa: E402  (bench/render_readme.py)

files = render_readme.load_results(ROOT / "bench" / "results")
works = render_readme.latest_rows(files)
print(f"{len(files)} GPU result file(s); works with results: {', '.join(works) or 'none'}")
for work in render_readme.TRAIN_WORKS:
    if work not in works:
        print(f"  {work}: {render_readme.NO_RESULT}")

# %%
# The speed table, drawn
# ----------------------
# For each training work of ``bench/bench_train.py``: its fastest schedlang variant against the
# fastest baseline measured in the same run (same command, same revision), both with a passing check,
# as tokens per second of the one over the other. Above 1, schedlang is faster. A work whose run has
# no baseline (the checkpointing ablation) has no bar.


def _label(header):
    sha = str(header.get("git_sha", "unknown"))[:10]
    return f"{header.get('device')} x{header.get('gpus')}, {header.get('date')}, {sha}"


def _passed(row):
    return str(row.get("check", "")).startswith("ok")


def _speed(row):
    """Higher is faster: tokens per second."""
    return row.get("tokens_per_s") or None


headline = []  # (work, speed-up, schedlang row, baseline row, header)
for work in render_readme.TRAIN_WORKS:
    if work not in works:
        continue
    header, rows = works[work]
    best = None
    for row in rows:
        if row.get("role") != "schedlang" or not _passed(row) or not _speed(row):
            continue
        baselines = [b for b in render_readme.same_run(row, rows, header)
                     if b.get("role") == "baseline" and _passed(b) and _speed(b)]
        if baselines:
            baseline = max(baselines, key=_speed)
            if best is None or _speed(row) / _speed(baseline) > best[1]:
                best = (work, _speed(row) / _speed(baseline), row, baseline, header)
    if best is not None:
        headline.append(best)

if headline:
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(headline) + 1.2))
    names = [work for work, *_ in headline]
    ax.barh(names, [speedup for _, speedup, *_ in headline],
            color=["tab:orange" if speedup >= 1 else "tab:gray" for _, speedup, *_ in headline])
    ax.axvline(1.0, color="black", linewidth=0.8)
    for y, (work, speedup, row, baseline, header) in enumerate(headline):
        ax.text(speedup, y, f" {speedup:.2f}x  ({header.get('device')} x{header.get('gpus')})", va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(speedup for _, speedup, *_ in headline) * 1.45)
    ax.set_xlabel("tokens/s of the fastest schedlang variant over the fastest baseline of its run")
    ax.set_title("training step, recorded GPU results", fontsize=9)
    ax.tick_params(labelsize=8)
    fig.tight_layout()
    plt.show()
    for work, speedup, row, baseline, header in headline:
        print(f"{work:22s} {speedup:.2f}x  {row.get('variant')} {row['ms']:.1f} ms/step against "
              f"{baseline.get('variant')} {baseline['ms']:.1f} ms/step ({_label(header)})")
else:
    print("No GPU step times are recorded yet: run bench/bench_train.py on a GPU to fill bench/results/.")

# %%
# Every variant that ran
# ----------------------
# All the rows of those runs: each variant's step time (lower is faster) and its peak GPU memory,
# schedlang's in orange, the baselines in grey.

drawn = [w for w in render_readme.TRAIN_WORKS if w in works and any(r.get("ms") for r in works[w][1])]
for work in drawn:
    header, rows = works[work]
    for r in rows:
        print(f"{work:22s} {str(r.get('variant'))[:58]:58s} {str(r.get('role')):9s} {r.get('ms') or '-':>8} ms "
              f"peak {r.get('peak_mem_gib') or '-'} GiB  check {str(r.get('check'))[:20]}")
if drawn:
    bars = [(work, r) for work in drawn for r in works[work][1] if r.get("ms")]
    fig, ax = plt.subplots(figsize=(10, 0.22 * len(bars) + 1.2))
    labels = [f"{work}: {r.get('variant')}"[:60] for work, r in bars]
    ax.barh(range(len(bars)), [r["ms"] for _, r in bars],
            color=["tab:orange" if r.get("role") == "schedlang" else "tab:gray" for _, r in bars])
    for y, (_, r) in enumerate(bars):
        note = f" {r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") else ""
        note += "" if _passed(r) else "  (check failed)"
        ax.text(r["ms"], y, note, va="center", fontsize=6)
    ax.set_yticks(range(len(bars)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.15 * max(r["ms"] for _, r in bars))
    ax.set_xlabel("step time (ms); peak GPU memory at the bar's end")
    fig.tight_layout()
    plt.show()

# %%
# Where a step's GPU time goes
# ----------------------------
# ``bench_train.py --profile DIR`` profiles three steps of every variant and keeps, with each row, the
# GPU time per kernel kind (``bench/profile_summary.py``: GEMMs, attention, the optimizer, Inductor's
# fused kernels, casts...). Stacked bars show what a schedule removed and what is left; a wide gap
# between the bar and the step time is time the GPU waited for the host.
profiled = {w: [r for r in works[w][1] if isinstance(r.get("profile"), dict)] for w in works}
profiled = {w: rows for w, rows in profiled.items() if rows}
for work, rows in profiled.items():
    kinds = sorted({k for r in rows for k in r["profile"]["by_kind_ms"]},
                   key=lambda k: -max(r["profile"]["by_kind_ms"].get(k, 0.0) for r in rows))
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.6))
    left = [0.0] * len(rows)
    for kind in kinds:
        widths = [r["profile"]["by_kind_ms"].get(kind, 0.0) for r in rows]
        ax.barh([str(r.get("variant")) for r in rows], widths, left=left, label=kind)
        left = [a + b for a, b in zip(left, widths)]
    ax.scatter([r.get("ms") or 0 for r in rows], [str(r.get("variant")) for r in rows], marker="|", s=300,
               color="black", label="step time")
    ax.set_xlabel("ms per step")
    ax.set_title(f"{work}: GPU time by kernel kind ({_label(works[work][0])})", fontsize=8)
    ax.set_xlim(0, 1.7 * max(max(left), max(r.get("ms") or 0 for r in rows)))  # room for the legend
    ax.legend(fontsize=6, ncol=2, loc="center right")
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    plt.show()
if not profiled:
    print("No profiled GPU rows are recorded yet: run bench/bench_train.py --profile DIR on a GPU.")

# %%
# Fused kernels against eager PyTorch and torch.compile
# -----------------------------------------------------
# ``bench/bench_kernels.py`` times each training-step kernel (forward and backward, LLaMA-1.1B sizes)
# three ways in one run: eager PyTorch, ``torch.compile`` of the same code, and schedlang's kernel.
# Its rows (``bench/results/*-kernels.json``) name the kernel (``work``) and the way (``variant``).
import json  # noqa: E402

for path in sorted((ROOT / "bench" / "results").glob("*-kernels.json")):
    data = json.loads(path.read_text())
    times = {}
    for row in data.get("rows", []):
        if row.get("ms") and str(row.get("check", "")).startswith("ok"):
            times.setdefault(row["work"], {})[row["variant"]] = row["ms"]
    kernels = [k for k, t in times.items() if "schedlang" in t and "eager" in t and "torch.compile" in t]
    if not kernels:
        continue
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(kernels) + 1.4))
    ys = range(len(kernels))
    ax.barh([y + 0.2 for y in ys], [times[k]["eager"] / times[k]["schedlang"] for k in kernels], height=0.4,
            color="tab:orange", label="schedlang over eager")
    ax.barh([y - 0.2 for y in ys], [times[k]["torch.compile"] / times[k]["schedlang"] for k in kernels], height=0.4,
            color="tab:blue", label="schedlang over torch.compile")
    ax.set_yticks(list(ys), kernels)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speed of schedlang's kernel (> 1 is faster), forward + backward")
    ax.set_title(f"training-step kernels ({_label(data)})", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.show()
    for k in kernels:
        print(f"{k:24s} eager {times[k]['eager']:.3f} ms  torch.compile {times[k]['torch.compile']:.3f} ms  "
              f"schedlang {times[k]['schedlang']:.3f} ms")
    break
else:
    print("No per-kernel GPU results are recorded yet (bench/results/*-kernels.json): "
          "run bench/bench_kernels.py on a GPU to record them.")

# %%
# Float8: each activation's scale is computed once
# ------------------------------------------------
# A float8 Linear (torchao, ``tensorwise``) scales each matmul operand by its largest magnitude,
# ``max(abs(x))``: one full read of the tensor. Compiled, the backward needs the scale of the same
# activations again, seen through a reshape, and the compiler's common-subexpression pass does not
# see through views, so it reads them a second time. ``compile_layers`` gives layers with float8
# Linears a joint-graph pass (``schedlang.graph.passes.shared_amax``) that points every such maximum
# at the first one. Below, a small float8 block (float8 emulated on the CPU) is compiled with and
# without it; a post-grad pass counts the whole-tensor maxima left in the forward and backward
# graphs. The recorded float8 rows above (``llama-1.1b-1gpu-fp8``) are measured with the pass on.
import copy  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from schedlang.graph.passes.shared_amax import SharedAmaxPass  # noqa: E402

try:
    import torchao.float8 as torchao_float8
except ImportError:
    torchao_float8 = None
    print("torchao is not installed (pip install 'schedlang[fp8]'): the float8 section is skipped")


class GatedMLP(nn.Module):
    def __init__(self, hidden=64, inner=128):
        super().__init__()
        self.gate, self.up = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def maxima_per_graph(block, x, with_pass):
    """Compile ``block``, run forward and backward; the whole-tensor maxima in each compiled graph."""
    counts = []

    class CountMaxima:
        def __call__(self, graph):
            counts.append(sum(n.target in (torch.ops.aten.max.default, torch.ops.aten.amax.default)
                              for n in graph.nodes))

        def uuid(self):
            return None

    options = {"post_grad_custom_post_pass": CountMaxima()}
    if with_pass:
        options["joint_custom_post_pass"] = SharedAmaxPass()
    torch._dynamo.reset()
    model = torch.compile(copy.deepcopy(block), options=options)
    out = model(x)
    out.float().square().sum().backward()
    return counts, out


if torchao_float8 is not None:
    torch.manual_seed(0)
    block = GatedMLP().to(torch.bfloat16)
    torchao_float8.convert_to_float8_training(block, config=torchao_float8.Float8LinearConfig(emulate=True))
    x = torch.randn(2, 24, 64, dtype=torch.bfloat16)
    (before, out_before), (after, out_after) = (maxima_per_graph(block, x, False), maxima_per_graph(block, x, True))
    print(f"whole-tensor maxima (forward, backward): without the pass {before}, with it {after}")
    assert sum(after) < sum(before) and torch.equal(out_after, out_before)

# %%
# Selective checkpointing on a small LLaMA, measured live
# -------------------------------------------------------
# ``sch["model.layers.i"].checkpoint()`` wraps one decoder layer in ``torch.utils.checkpoint``: its
# activations are dropped after the forward and recomputed in the backward. Checkpointing every n-th
# layer trades memory for time. We count the bytes autograd saves for the backward with
# ``torch.autograd.graph.saved_tensors_hooks`` (a checkpointed layer saves only its input) and time a
# training step, for n = every layer, every second layer, ..., none.
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import schedlang  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(1)
N_LAYERS = 8
config = LlamaConfig(num_hidden_layers=N_LAYERS, hidden_size=64, intermediate_size=172, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=256, max_position_embeddings=128)
base = LlamaForCausalLM(config).eval()
ids = torch.randint(0, config.vocab_size, (4, 96))


def saved_bytes_and_step_ms(every):
    """Checkpoint layers 0, every, 2*every, ... (every=0: none); saved bytes and median step time."""
    sch = schedlang.create_schedule(base)
    if every:
        for i in range(0, N_LAYERS, every):
            sch[f"model.layers.{i}"].checkpoint()
    model, _ = schedlang.build(sch)
    model.train()
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss.backward()
    times = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append((time.perf_counter() - start) * 1e3)
    return total, sorted(times)[1]


settings = [1, 2, 4, 8, 0]
points = []
for every in settings:
    saved, ms = saved_bytes_and_step_ms(every)
    n_ckpt = len(range(0, N_LAYERS, every)) if every else 0
    points.append((n_ckpt, saved / 2**20, ms))
    print(f"checkpoint every {every or '-'} layer(s) ({n_ckpt}/{N_LAYERS} layers): "
          f"saved for backward {saved / 2**20:.2f} MiB, step {ms:.1f} ms (CPU)")

# Saved activations must fall as more layers are checkpointed: a check, not a figure of speech.
assert points[0][1] < points[-1][1], "checkpointing every layer should save less than checkpointing none"

fig, ax_mem = plt.subplots(figsize=(6.5, 3.6))
xs = [p[0] for p in points]
ax_mem.plot(xs, [p[1] for p in points], "o-", color="tab:blue", label="saved for backward (MiB)")
ax_mem.set_xlabel(f"checkpointed decoder layers (of {N_LAYERS})")
ax_mem.set_ylabel("activations saved for backward (MiB)", color="tab:blue")
ax_time = ax_mem.twinx()
ax_time.plot(xs, [p[2] for p in points], "s--", color="tab:red", label="step time (ms)")
ax_time.set_ylabel("forward + backward (ms, CPU)", color="tab:red")
ax_mem.set_title("selective checkpointing on a small LLaMA (CPU: the shape of the trade-off, not GPU speed)",
                 fontsize=8)
fig.tight_layout()
plt.show()

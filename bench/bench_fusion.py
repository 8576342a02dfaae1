"""Vertical fusion: schedlang's generated Triton kernels against eager PyTorch and torch.compile.

Patterns, 8192 x 4096 bf16 activations (64 MiB per tensor, larger than the L2 cache):

* bias + GELU, ``F.gelu(x + bias)`` with the exact (erf) form as in the reference figures,
  and the tanh form;
* bias + dropout + residual + LayerNorm, ``LayerNorm(dropout(x + bias) + residual)`` with the
  dropout in eval mode (an identity), the post-attention block of BERT/GPT-2.

Each pattern is timed forward only (inputs without gradients) and forward + backward
(``torch.autograd.grad`` of the output w.r.t. the inputs and the LayerNorm weights, with a
random incoming gradient). Forward + backward is also timed with schedlang's kernels launched
through Triton's JIT at every call (``SCHEDLANG_DIRECT_LAUNCH=0``), as they were before the
compiled binaries were called directly. Times are medians of ``triton.testing.do_bench`` (L2 flushed
before each call). The floor of each row is the bytes it must move over the copy bandwidth
measured here (a 2 GiB device-to-device copy, bytes read + written over its time):

* bias + GELU forward: read x, write y (2 passes of 64 MiB); backward: read x and dy, write
  dx (3 passes); the bias and its gradient are 8 KiB.
* LayerNorm block forward: read x and residual, write y (3 passes); backward: read x,
  residual and dy, write one gradient shared by x and residual (4 passes).

Usage: python bench/bench_fusion.py [--out results.md] [--rows 8192] [--cols 4096]

Rows also go to ``bench/results/<date>-fusion.json`` (``bench/harness.py``), each against
``torch.compile`` of the same pattern, for the README.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/harness.py)

from schedlang.lowering import lower_subgraph  # noqa: E402

DEV = "cuda"
ROWS = []


def log(msg):
    print(msg, flush=True)


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    src = torch.randn(1 << 29, device=DEV)  # 2 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=100, rep=500, return_mode="median")
    del src, dst
    return 2 * (1 << 29) * 4 / (ms * 1e-3)


class BiasDropoutResidualLayerNorm(nn.Module):
    def __init__(self, hidden, p=0.1):
        super().__init__()
        self.dropout = nn.Dropout(p)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x, bias, residual):
        return self.norm(self.dropout(x + bias) + residual)


def timed(fn):
    """(median ms, first-call seconds, host ms per call when the GPU is not waited for)."""
    from triton.testing import do_bench

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        fn()
    host = (time.perf_counter() - t0) / 50 * 1e3  # enqueue time (the GPU runs behind)
    torch.cuda.synchronize()
    return ms, first, host


def row(pattern, variant, ms, floor_ms, first, host, base=None):
    ROWS.append(dict(pattern=pattern, variant=variant, ms=ms, floor=floor_ms, first=first, host=host, base=base))
    extra = "" if base is None else f"  eager/this x{base['eager'] / ms:.2f}  compile/this x{base['compile'] / ms:.2f}"
    log(f"{pattern:34s} {variant:22s} {ms:8.4f} ms  /floor x{ms / floor_ms:.2f}  first {first:6.2f}s  "
        f"host {host:.3f} ms{extra}")


def bench_pattern(name, fn_eager, inputs, params, floor_fwd, floor_fwdbwd, make_fused, check_tol):
    compiled = torch.compile(fn_eager)
    fused = make_fused()
    variants = {"eager": fn_eager, "torch.compile": compiled, "schedlang triton": fused}

    with torch.no_grad():
        ref = fn_eager(*inputs)

    base = {}  # the first timed call of each variant includes its compilation (and schedlang's tuning)
    for label, f in variants.items():
        def forward(f=f):
            with torch.no_grad():
                return f(*inputs)

        ms, first, host = timed(forward)
        if label == "eager":
            base["eager"] = ms
        if label == "torch.compile":
            base["compile"] = ms
        row(f"{name} fwd", label, ms, floor_fwd, first, host, base if label == "schedlang triton" else None)

    grad_inputs = [t.detach().requires_grad_() for t in inputs]
    wrt = grad_inputs + params
    dy = torch.randn_like(ref)
    # the same kernels launched through Triton's JIT at every call (its per-call binding and
    # hashing) instead of calling the compiled binary directly: what the direct launch saves
    jit_launched = make_fused()
    os.environ["SCHEDLANG_DIRECT_LAUNCH"] = "0"  # read when the kernels are first loaded
    try:
        torch.autograd.grad(jit_launched(*grad_inputs), wrt, dy)
    finally:
        del os.environ["SCHEDLANG_DIRECT_LAUNCH"]
    base = {}
    for label, f in dict(variants, **{"schedlang, JIT launch": jit_launched}).items():
        def step(f=f):
            return torch.autograd.grad(f(*grad_inputs), wrt, dy)

        ms, first, host = timed(step)
        if label == "eager":
            base["eager"] = ms
        if label == "torch.compile":
            base["compile"] = ms
        row(f"{name} fwd+bwd", label, ms, floor_fwdbwd, first, host, base if label.startswith("schedlang") else None)
    # the fused module against eager on these inputs: outputs, then gradients
    with torch.no_grad():
        torch.testing.assert_close(fused(*inputs).float(), ref.float(), **check_tol)
    got = torch.autograd.grad(fused(*grad_inputs), wrt, dy)
    want = torch.autograd.grad(fn_eager(*grad_inputs), wrt, dy)
    for a, b in zip(got, want):
        scale = max(1.0, b.float().abs().max().item())
        torch.testing.assert_close(a.float() / scale, b.float() / scale, **check_tol)
    return fused


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=4096)
    args = parser.parse_args()
    import logging

    import triton

    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("schedlang.lowering").setLevel(logging.INFO)  # the launch choices timed

    torch.manual_seed(0)
    device_name = torch.cuda.get_device_name()
    log(f"device {device_name}, torch {torch.__version__}, triton {triton.__version__}")
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write)")
    R, N = args.rows, args.cols
    dtype = torch.bfloat16
    tensor_bytes = R * N * torch.finfo(dtype).bits // 8
    passes = lambda n: n * tensor_bytes / bw * 1e3  # noqa: E731
    tol = dict(rtol=2e-2, atol=3e-2)

    x = torch.randn(R, N, device=DEV, dtype=dtype)
    bias = torch.randn(N, device=DEV, dtype=dtype)
    residual = torch.randn(R, N, device=DEV, dtype=dtype)

    sources = {}
    def bias_gelu_of(approximate):
        def bias_gelu(x, bias):
            return F.gelu(x + bias, approximate=approximate)
        return bias_gelu

    for approximate in ("none", "tanh"):
        bias_gelu = bias_gelu_of(approximate)

        def make(bias_gelu=bias_gelu):
            gm = torch.fx.symbolic_trace(bias_gelu)
            return lower_subgraph(gm, "triton", "BiasGeLU", example_inputs=[x, bias])

        fused = bench_pattern(f"bias+gelu({approximate}) {R}x{N} bf16", bias_gelu, [x, bias], [], passes(2),
                              passes(5), make, tol)
        sources[f"bias+gelu({approximate})"] = fused.source

    block = BiasDropoutResidualLayerNorm(N).to(DEV, dtype).eval()
    with torch.no_grad():
        block.norm.weight.normal_()
        block.norm.bias.normal_()

    def make_block():
        gm = torch.fx.symbolic_trace(block)
        return lower_subgraph(gm, "triton", "BiasDropResLN", example_inputs=[x, bias, residual]).eval()

    fused = bench_pattern(f"bias+dropout(eval)+res+LN {R}x{N} bf16", block, [x, bias, residual],
                          list(block.parameters()), passes(3), passes(7), make_block, tol)
    sources["bias+dropout+residual+layernorm"] = fused.source

    log("\n==== summary")
    lines = ["| pattern | variant | median ms | / floor | eager / this | compile / this | first call s |"
             " host ms/call |", "|---|---|---|---|---|---|---|---|"]
    for r in ROWS:
        base = r["base"]
        lines.append(f"| {r['pattern']} | {r['variant']} | {r['ms']:.4f} | {r['ms'] / r['floor']:.2f} | "
                     + (f"{base['eager'] / r['ms']:.2f} | {base['compile'] / r['ms']:.2f}" if base else " | ")
                     + f" | {r['first']:.2f} | {r['host']:.3f} |")
    from schedlang.lowering.triton_backend import _TUNED

    tuned = [f"- {k[0]} at {k[2]}x{k[3]}: BLOCK_R={v[0]} BLOCK_N={v[1]} num_warps={v[2]}" for k, v in _TUNED.items()]
    log("\n".join(tuned))
    floors = sorted({(r["pattern"], r["floor"]) for r in ROWS})
    table = "\n".join(lines)
    log(table)
    for pattern, floor_ms in floors:
        log(f"floor {pattern}: {floor_ms:.4f} ms")
    if args.out:
        header = [
            f"# Vertical fusion benchmark, {datetime.date.today().isoformat()}",
            "",
            f"Device: {device_name}; torch {torch.__version__}; triton {triton.__version__}.",
            f"Copy bandwidth measured in the same run: {bw / 1e12:.3f} TB/s (bytes read + written).",
            "Command: `python bench/bench_fusion.py` (one process, baselines and schedlang side by side).",
            "",
            table,
            "",
            "Floors (bytes that must move / copy bandwidth):",
            "",
        ] + [f"- {p}: {f:.4f} ms" for p, f in floors] + ["", "Launch choices (timed once per kernel and shape):", ""] + tuned
        Path(args.out).write_text("\n".join(header) + "\n")
        src_path = Path(args.out).with_suffix(".kernels.py")
        src_path.write_text("\n\n".join(f"# ===== {k}\n{v}" for k, v in sources.items()))
    rows = [harness.micro_row(r["pattern"], r["variant"], "schedlang" if r["variant"].startswith("schedlang")
                              else "baseline", r["ms"], baseline="torch.compile", floor_ms=round(r["floor"], 4),
                              first_call_s=round(r["first"], 3), host_ms=round(r["host"], 4)) for r in ROWS]
    log(f"wrote {harness.write_results('fusion', rows, gpus=1, copy_bandwidth_tb_s=round(bw / 1e12, 3))}")


if __name__ == "__main__":
    main()

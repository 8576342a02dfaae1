"""Training-step kernels against eager PyTorch and torch.compile, forward + backward, LLaMA-1.1B sizes.

Shapes (bf16): batch 4 x sequence 2048 = 8192 tokens, hidden 2048, 32 query heads and 4 key/value
heads of 64, intermediate 5632, vocabulary 32000. Works:

* ``rms_norm``: RMSNorm of (8192, 2048); ``add_rms_norm``: the residual add fused in;
* ``rotary``: q (4, 32, 2048, 64) in HF's transposed layout and k (4, 4, 2048, 64);
* ``swiglu``: silu(gate) * up on (8192, 5632);
* ``linear_cross_entropy``: LM head + loss, 8192 x 2048 -> 32000 (eager and compiled materialize the
  logits; schedlang's kernel at its default chunking and at 2048 / 8192 tokens per chunk);
* ``embedding``: the token lookup of 8192 ids in an fp32 (32000, 2048) weight, as in the training steps
  (fp32 embedding, the residual stream in fp32), and its weight's gradient; ``embedding_pad_half``: the same
  with half the ids one token (a padded batch), where one id has thousands of rows to sum.

Each variant runs forward and backward (gradients of every input) in one call. ``ms`` is the GPU's
time for the call (:func:`bench.harness.gpu_time_ms`: median, L2 flushed before each call, the host
kept ahead of the GPU), what the call costs inside a training step whose host runs ahead.
``wall_ms`` is ``triton.testing.do_bench``'s time of the same call, host included: where it is well
above ``ms``, a call alone is bound by its launches (autograd, the Triton launcher), which a compiled
or captured step does not pay per kernel in the same way. ``peak_mem_gib`` is the peak
allocated during one call above what was allocated before it. Before timing, every variant's
output and gradients are compared with eager PyTorch in fp32 on the same bf16 inputs
(``check``: the largest error relative to the largest magnitude of the expected tensor).
Rows go to ``bench/results/<date>-kernels.json`` (see ``bench/harness.py``); ``gb_per_s`` counts
the bytes the fused kernel must move (each comment in ``schedlang/kernels/`` states them).

Usage: python bench/bench_kernels.py [--works rms_norm,swiglu] [--skip-compile] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.harness import (failed_row, free_memory, gpu_time_ms, make_row, text_table,  # noqa: E402
                           write_results)

DEV = "cuda"
DTYPE = torch.bfloat16
BATCH, SEQ, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4, 2048, 2048, 32, 4, 64, 5632, 32000
TOKENS = BATCH * SEQ


def log(msg: str) -> None:
    print(msg, flush=True)


def _max_relative_error(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        g, w = g.detach().float(), w.detach().float()
        worst = max(worst, ((g - w).abs().max() / w.abs().max().clamp_min(1e-6)).item())
    return worst


def _run_once(fn: Callable, inputs: List[torch.Tensor], cotangents) -> List[torch.Tensor]:
    """Forward + backward; returns the outputs followed by the inputs' gradients."""
    for x in inputs:
        x.grad = None
    out = fn(*inputs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    torch.autograd.backward(outs, cotangents)
    return [o.detach() for o in outs] + [x.grad for x in inputs]


def bench_work(work: str, variants: Dict[str, Callable], make_inputs: Callable, truth: Callable,
               bytes_moved: float, flops: float, tolerance: float) -> List[dict]:
    """Time every variant of one work; ``truth`` (eager, fp32) gives the expected values."""
    from triton.testing import do_bench

    rows = []
    inputs = make_inputs()
    with torch.no_grad():
        probe = truth(*[x.detach().float() for x in inputs])
    probe = list(probe) if isinstance(probe, (tuple, list)) else [probe]
    cotangents = [torch.randn_like(p).to(DTYPE) if p.dim() else torch.ones((), device=DEV) for p in probe]
    wide = [x.detach().float().requires_grad_(True) for x in inputs]
    expected = _run_once(truth, wide, [c.float() for c in cotangents])
    for variant, fn in variants.items():
        role = "baseline" if not variant.startswith("schedlang") else "schedlang"
        try:
            got = _run_once(fn, inputs, cotangents)
            err = _max_relative_error(got, expected)
            check = f"ok (max rel err {err:.2g})" if err <= tolerance else f"FAIL max rel err {err:.3g} > {tolerance}"
            del got
            free_memory()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            _run_once(fn, inputs, cotangents)
            torch.cuda.synchronize()
            peak = round((torch.cuda.max_memory_allocated() - base) / 2 ** 30, 3)
            wall_ms = do_bench(lambda: _run_once(fn, inputs, cotangents), warmup=25, rep=200, return_mode="median")
            ms = gpu_time_ms(lambda: _run_once(fn, inputs, cotangents))
            row = make_row(work, variant, role, ms, TOKENS, flops, 1, peak, check, wall_ms=round(wall_ms, 4),
                           gb_per_s=round(bytes_moved / (ms * 1e-3) / 1e9, 1) if bytes_moved else None)
        except Exception as exc:  # one failing variant must not end the benchmark
            row = failed_row(work, variant, role, exc)
        wall = f"  (wall {row['wall_ms']:.3f} ms)" if row.get("wall_ms") is not None else ""
        log(f"{work:22s} {variant:28s} {row['ms'] if row['ms'] is not None else '-':>8} ms{wall}  {row['check']}")
        rows.append(row)
        free_memory()
    return rows


def _variants(reference: Callable, ours: Callable, compile_baseline: bool, **extra: Callable) -> Dict[str, Callable]:
    out = {"eager": reference}
    if compile_baseline:
        out["torch.compile"] = torch.compile(reference, dynamic=False)
    out["schedlang"] = ours
    out.update({f"schedlang {k}": v for k, v in extra.items()})
    return out


def main(argv=None) -> None:
    from schedlang.kernels import apply_rotary, embedding, fused_linear_cross_entropy, rms_norm, swiglu
    from schedlang.kernels.embedding import reference as embedding_reference
    from schedlang.kernels.fused_linear_cross_entropy import reference as lce_reference
    from schedlang.kernels.rms_norm import reference as rms_reference
    from schedlang.kernels.rotary import reference as rotary_reference
    from schedlang.kernels.swiglu import reference as swiglu_reference

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--works", default="rms_norm,add_rms_norm,rotary,swiglu,linear_cross_entropy,embedding,"
                                           "embedding_pad_half")
    parser.add_argument("--skip-compile", action="store_true", help="no torch.compile baselines")
    parser.add_argument("--results-dir", default=None, help="where the JSON goes (default: bench/results)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA device")
    torch.manual_seed(0)
    compile_baseline = not args.skip_compile
    works = args.works.split(",")

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEV) * scale).to(DTYPE).requires_grad_(True)

    rows: List[dict] = []
    elt = 2  # bytes per bf16 element
    if "rms_norm" in works:
        n = TOKENS * HIDDEN
        rows += bench_work(
            "rms_norm", _variants(lambda x, w: rms_reference(x, w, 1e-5), lambda x, w: rms_norm(x, w, 1e-5),
                                  compile_baseline),
            lambda: [leaf(TOKENS, HIDDEN), leaf(HIDDEN, scale=0.1)], lambda x, w: rms_reference(x, w, 1e-5),
            bytes_moved=5 * n * elt, flops=0.0, tolerance=2e-2)
    if "add_rms_norm" in works:
        n = TOKENS * HIDDEN
        rows += bench_work(
            "add_rms_norm", _variants(lambda x, r, w: rms_reference(x, w, 1e-5, r),
                                      lambda x, r, w: rms_norm(x, w, 1e-5, r), compile_baseline),
            lambda: [leaf(TOKENS, HIDDEN), leaf(TOKENS, HIDDEN), leaf(HIDDEN, scale=0.1)],
            lambda x, r, w: rms_reference(x, w, 1e-5, r), bytes_moved=8 * n * elt, flops=0.0, tolerance=2e-2)
    if "rotary" in works:
        angles = torch.randn(1, SEQ, HEAD_DIM // 2, device=DEV)
        angles = torch.cat([angles, angles], -1)
        cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)

        def make():
            q = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, device=DEV).to(DTYPE).transpose(1, 2).requires_grad_(True)
            k = torch.randn(BATCH, SEQ, KV_HEADS, HEAD_DIM, device=DEV).to(DTYPE).transpose(1, 2).requires_grad_(True)
            return [q, k]

        n = BATCH * SEQ * (HEADS + KV_HEADS) * HEAD_DIM
        rows += bench_work(
            "rotary", _variants(lambda q, k: rotary_reference(q, k, cos, sin), lambda q, k: apply_rotary(q, k, cos, sin),
                                compile_baseline),
            make, lambda q, k: rotary_reference(q, k, cos.float(), sin.float()),
            bytes_moved=4 * n * elt, flops=0.0, tolerance=2e-2)
    if "swiglu" in works:
        n = TOKENS * INTER
        rows += bench_work(
            "swiglu", _variants(swiglu_reference, swiglu, compile_baseline),
            lambda: [leaf(TOKENS, INTER, scale=3.0), leaf(TOKENS, INTER)], swiglu_reference,
            bytes_moved=8 * n * elt, flops=0.0, tolerance=2e-2)
    if "linear_cross_entropy" in works:
        target = torch.randint(0, VOCAB, (TOKENS,), device=DEV)
        target[::50] = -100

        def lce(chunk=None):
            return lambda h, w: fused_linear_cross_entropy(h, w, target, chunk_size=chunk)

        rows += bench_work(
            "linear_cross_entropy",
            _variants(lambda h, w: lce_reference(h, w, target), lce(), compile_baseline,
                      **{"chunk 2048": lce(2048), "chunk 8192": lce(8192)}),
            lambda: [leaf(TOKENS, HIDDEN), leaf(VOCAB, HIDDEN, scale=0.02)],
            lambda h, w: lce_reference(h, w, target),
            bytes_moved=0.0, flops=6.0 * TOKENS * HIDDEN * VOCAB, tolerance=3e-2)

    for work in ("embedding", "embedding_pad_half"):
        if work not in works:
            continue
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=DEV)
        if work == "embedding_pad_half":
            ids[:, SEQ // 2:] = 0
        # the output's forward write and read back, the incoming fp32 gradient, the weight's fp32 gradient
        fp32 = 4
        rows += bench_work(
            work, _variants(lambda w, ids=ids: embedding_reference(ids, w), lambda w, ids=ids: embedding(ids, w),
                            compile_baseline),
            lambda: [torch.randn(VOCAB, HIDDEN, device=DEV).requires_grad_(True)],
            lambda w, ids=ids: embedding_reference(ids, w),
            bytes_moved=(3 * TOKENS + VOCAB) * HIDDEN * fp32, flops=0.0, tolerance=1e-4)

    path = write_results("kernels", rows, gpus=1,
                         directory=Path(args.results_dir) if args.results_dir else None)
    log("\n" + text_table(rows))
    log(f"\nwritten to {path}")


if __name__ == "__main__":
    main()

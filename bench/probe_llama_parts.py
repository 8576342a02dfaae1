"""Where a LLaMA-1.1B training step could still lose time: its parts timed alone on one GPU (no model).

    python bench/probe_llama_parts.py      # on a GPU; prints one line per part and then all of them as JSON
    python bench/probe_llama_parts.py D    # only the norms (part D)

At the shapes of ``bench_train.py --work llama-1.1b-1gpu`` (batch 4 x 2048 = 8192 tokens, hidden 2048, 16
query and 16 key/value heads of 128, MLP 5632, bf16), each part forward and backward where it has one,
timed with ``triton.testing.do_bench`` (median). (Parts A and C once ran at TinyLlama's grouped shape instead,
32 query and 4 key/value heads of 64: the figures in ``bench/results/2026-11-27-llama-1gpu-analysis.md``.)

* (A) the q/k/v projections as three GEMMs, as one GEMM on weights concatenated on every call, and on one
  stored concatenated weight; the same for the MLP's gate and up projections (with SiLU(gate) * up);
* (B) 132 MLP-sized GEMMs alone, a fused AdamW over 1.1B fp32 parameters (22 groups) alone, and both at once
  on two streams: how much of the optimizer a concurrent backward could hide;
* (C) the floor of one decoder layer: all its GEMMs forward and backward, cuDNN and Flash attention forward
  and backward, and the LM head's GEMMs over the full logits;
* (D) the residual add + RMSNorm, forward and backward: HF's code compiled by Inductor (default and with
  coordinate-descent tuning) against ``schedlang.kernels.rms_norm``, and that kernel's backward alone over
  rows per iteration, warps and programs per SM.

These are probes for choosing what to build next, not figures: the training step itself is measured by
``bench_train.py``, against its baselines in the same process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Dict

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_llama_floor import WORK  # noqa: E402  (bench/probe_llama_floor.py: the work's shape, kept in one place)

TOKENS, HIDDEN, INTERMEDIATE, VOCAB, HEADS, LAYERS = (WORK.tokens, WORK.hidden, WORK.intermediate, WORK.vocab,
                                                       WORK.heads, WORK.layers)
KV = HIDDEN  # as many key/value heads as query heads
PARAMS = 1_100_000_000
BF16 = torch.bfloat16


def main(parts: str = "ABCD") -> Dict[str, float]:
    from triton.testing import do_bench

    torch.manual_seed(0)
    results: Dict[str, float] = {}

    def bench(fn: Callable[[], object], name: str) -> None:
        results[name] = do_bench(fn, warmup=50, rep=300, return_mode="median")
        print(f"{name:40s} {results[name]:8.3f} ms", flush=True)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, device="cuda", dtype=BF16) * 0.02).requires_grad_()

    def grad(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=BF16)

    if parts == "D":
        _norms(bench)
        print(json.dumps(results))
        return results
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=BF16, requires_grad=True)
    wq, wk, wv = weight(HIDDEN, HIDDEN), weight(KV, HIDDEN), weight(KV, HIDDEN)
    wqkv = torch.cat([wq, wk, wv]).detach().requires_grad_()
    wg, wu, wd = weight(INTERMEDIATE, HIDDEN), weight(INTERMEDIATE, HIDDEN), weight(HIDDEN, INTERMEDIATE)
    wgu = torch.cat([wg, wu]).detach().requires_grad_()
    gq, gk, gv, gm = grad(TOKENS, HIDDEN), grad(TOKENS, KV), grad(TOKENS, KV), grad(TOKENS, INTERMEDIATE)
    sizes = [HIDDEN, KV, KV]

    # (A) one GEMM for projections that read the same input
    def qkv_sep():
        torch.autograd.backward([F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)], [gq, gk, gv])

    def qkv_cat_each():
        torch.autograd.backward(list(F.linear(x, torch.cat([wq, wk, wv])).split(sizes, -1)), [gq, gk, gv])

    def qkv_fused_param():
        torch.autograd.backward(list(F.linear(x, wqkv).split(sizes, -1)), [gq, gk, gv])

    def mlp_sep():
        (F.silu(F.linear(x, wg)) * F.linear(x, wu)).backward(gm)

    def mlp_cat_each():
        gate, up = F.linear(x, torch.cat([wg, wu])).chunk(2, -1)
        (F.silu(gate) * up).backward(gm)

    def mlp_fused_param():
        gate, up = F.linear(x, wgu).chunk(2, -1)
        (F.silu(gate) * up).backward(gm)

    for fn in (qkv_sep, qkv_cat_each, qkv_fused_param, mlp_sep, mlp_cat_each, mlp_fused_param):
        for p in (x, wq, wk, wv, wqkv, wg, wu, wgu):
            p.grad = None
        bench(fn, fn.__name__)
    bench(lambda: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)), "qkv_fwd_sep")
    bench(lambda: F.linear(x, wqkv), "qkv_fwd_fused")
    bench(lambda: (F.linear(x, wg), F.linear(x, wu)), "gu_fwd_sep")
    bench(lambda: F.linear(x, wgu), "gu_fwd_fused")

    # (B) the optimizer on a second stream while GEMMs run
    params = [(torch.randn(PARAMS // LAYERS, device="cuda") * 0.02).requires_grad_() for _ in range(LAYERS)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizers = [torch.optim.AdamW([p], lr=1e-4, fused=True) for p in params]
    for o in optimizers:
        o.step()  # the state exists before timing
    a = torch.randn(TOKENS, INTERMEDIATE, device="cuda", dtype=BF16)
    b = torch.randn(INTERMEDIATE, HIDDEN, device="cuda", dtype=BF16)
    side = torch.cuda.Stream()

    def gemms():
        for _ in range(LAYERS * 6):
            a @ b

    def adamw():
        for o in optimizers:
            o.step()

    def both():
        ready = torch.cuda.Event()
        ready.record()
        side.wait_event(ready)
        with torch.cuda.stream(side):
            adamw()
        gemms()
        torch.cuda.current_stream().wait_stream(side)

    bench(gemms, "gemms_alone")
    bench(adamw, "adamw_1.1B_alone")
    bench(both, "gemms_plus_adamw_concurrent")
    del params, optimizers

    # (C) the floor of a layer, its attention and the LM head
    from torch.nn.attention import SDPBackend, sdpa_kernel

    wo = weight(HIDDEN, HIDDEN)

    def layer_gemms():
        q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
        o = F.linear(q, wo)
        gate, up = F.linear(o, wg), F.linear(o, wu)
        down = F.linear(up, wd)
        torch.autograd.backward([down, k, v, gate], [gq, gk, gv, gm])

    bench(layer_gemms, "layer_all_gemms_fwd_bwd")
    shape = (4, HEADS, 2048, HIDDEN // HEADS)
    heads = [torch.randn(*shape, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3)]
    grad_out = torch.randn(*shape, device="cuda", dtype=BF16)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        def attention(backend=backend):
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(*heads, is_causal=True).backward(grad_out)

        bench(attention, f"attention_{backend.name}_fwd_bwd")
    head, grad_logits = weight(VOCAB, HIDDEN), grad(TOKENS, VOCAB)
    bench(lambda: F.linear(x, head).backward(grad_logits), "lm_head_fwd_bwd_full")
    del head, grad_logits, heads, grad_out
    _norms(bench)
    print(json.dumps(results))
    return results


def _kernel_times(fn: Callable[[], object], steps: int = 20) -> Dict[str, float]:
    """GPU time per call of ``fn`` by kernel name (µs), from the profiler: ``do_bench`` of a few tens of µs
    of GPU work measures the host's launch time instead."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    times: Dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            times[event.key[:70]] = round(event.device_time_total / steps, 1)
    return times


def _norms(bench: Callable[[Callable[[], object], str], None]) -> None:
    import importlib

    import triton

    kernel = importlib.import_module("schedlang.kernels.rms_norm")
    eps = 1e-5
    x, r = (torch.randn(TOKENS, HIDDEN, device="cuda", dtype=BF16, requires_grad=True) for _ in range(2))
    w = torch.ones(HIDDEN, device="cuda", dtype=BF16, requires_grad=True)
    dy, ds = torch.randn_like(x), torch.randn_like(x)

    def hf_add_norm(x, r, w):
        s = x + r
        h = s.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(s.dtype), s

    def report(fn: Callable[[], object], name: str) -> None:
        times = _kernel_times(fn)
        print(f"{name}: {sum(times.values()):.1f} us of kernels per call", flush=True)
        for key, us in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"    {us:8.1f} us  {key}", flush=True)

    for label, options in (("inductor", {}), ("inductor_cdt", {"coordinate_descent_tuning": True})):
        torch._dynamo.reset()
        compiled = torch.compile(hf_add_norm, options=options)
        report(lambda: torch.autograd.backward(compiled(x, r, w), [dy, ds]), f"add_norm_{label}_fwd_bwd")
    report(lambda: torch.autograd.backward(kernel.rms_norm(x, w, eps, residual=r), [dy, ds]),
           "add_norm_triton_fwd_bwd")
    s = (x + r).detach()
    rstd = torch.rsqrt(s.float().pow(2).mean(-1) + eps)
    dx = torch.empty_like(s)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sweep = {}
    for rows in (1, 2, 4, 8):
        for warps in (4, 8, 16):
            for per_sm in (1, 2, 4):
                programs = min(triton.cdiv(TOKENS, rows), per_sm * sms)
                partial = torch.empty((programs, HIDDEN), device="cuda", dtype=torch.float32)

                def backward(rows=rows, warps=warps, programs=programs, partial=partial):
                    kernel._rms_norm_backward_kernel[(programs,)](
                        dy, s, w, rstd, ds, dx, partial, TOKENS, HIDDEN, HIDDEN, HIDDEN, HIDDEN, HIDDEN,
                        HAS_RESIDUAL_GRAD=True, IN_DTYPE=kernel.triton_dtype(BF16), BLOCK_N=HIDDEN,
                        BLOCK_M=rows, num_warps=warps)

                times = _kernel_times(backward, steps=10)
                sweep[f"rows{rows}_warps{warps}_sm{per_sm}"] = sum(times.values())
    for key, us in sorted(sweep.items(), key=lambda kv: kv[1])[:8]:
        print(f"norm backward kernel {key}: {us:.1f} us", flush=True)


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:2])

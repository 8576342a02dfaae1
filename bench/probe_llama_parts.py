"""Where a LLaMA-1.1B training step could still lose time: its parts timed alone on one GPU (no model).

    python bench/probe_llama_parts.py      # on a GPU; prints one line per part and then all of them as JSON

At the shapes of ``bench_train.py --work llama-1.1b-1gpu`` (batch 4 x 2048 = 8192 tokens, hidden 2048, 32
query and 4 key/value heads of 64, MLP 5632, bf16), each part forward and backward where it has one,
timed with ``triton.testing.do_bench`` (median):

* (A) the q/k/v projections as three GEMMs, as one GEMM on weights concatenated on every call, and on one
  stored concatenated weight; the same for the MLP's gate and up projections (with SiLU(gate) * up);
* (B) 132 MLP-sized GEMMs alone, a fused AdamW over 1.1B fp32 parameters (22 groups) alone, and both at once
  on two streams: how much of the optimizer a concurrent backward could hide;
* (C) the floor of one decoder layer: all its GEMMs forward and backward, cuDNN and Flash attention forward
  and backward, and the LM head's GEMMs over the full logits.

These are probes for choosing what to build next, not figures: the training step itself is measured by
``bench_train.py``, against its baselines in the same process.
"""

from __future__ import annotations

import json
from typing import Callable, Dict

import torch
import torch.nn.functional as F

TOKENS, HIDDEN, KV, INTERMEDIATE, VOCAB = 8192, 2048, 256, 5632, 32000
LAYERS, PARAMS = 22, 1_100_000_000
BF16 = torch.bfloat16


def main() -> Dict[str, float]:
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
    heads = [torch.randn(4, 32, 2048, 64, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3)]
    grad_out = torch.randn(4, 32, 2048, 64, device="cuda", dtype=BF16)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        def attention(backend=backend):
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(*heads, is_causal=True).backward(grad_out)

        bench(attention, f"attention_{backend.name}_fwd_bwd")
    head, grad_logits = weight(VOCAB, HIDDEN), grad(TOKENS, VOCAB)
    bench(lambda: F.linear(x, head).backward(grad_logits), "lm_head_fwd_bwd_full")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()

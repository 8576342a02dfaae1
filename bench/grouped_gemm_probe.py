"""The experts of one mixture-of-experts layer, forward and backward: the family's loop against grouped products.

    python bench/grouped_gemm_probe.py [--results-dir DIR]     # on a GPU; bench/results by default
    python bench/grouped_gemm_probe.py --tiny                  # the interpreter on the CPU: the script runs

A Qwen3-30B-A3B-shaped layer (128 experts, hidden 2048, moe_intermediate 768, top-8 of 8192 tokens, bf16;
65536 rows in all) computed three ways from the same tokens, choices and routing weights:

* ``family_loop``: transformers' ``Qwen3MoeExperts.forward`` (eager), one pair of matmuls per expert hit;
* ``triton``: the tokens' rows sorted by expert, :func:`schedlang.kernels.grouped_gemm_experts.grouped_experts_forward`
  with ``grouped_mm(backend="triton")``, the weighted rows summed back per token;
* ``torch_grouped_mm``: the same with ``backend="torch"`` (``torch._grouped_mm``), where this PyTorch and GPU have it.

``ms`` is :func:`harness.gpu_time_ms` of one forward and backward (the gradient of the output's sum against
a fixed random cotangent, of the tokens, the routing weights and both weight tensors); ``tflops`` counts the
six matmul passes (``3 * 2 * rows * 3 * H * I``). Each way's output and gradients are checked against the
family's (``check``: "ok" or "FAIL <what> <error>", bf16 tolerance scaled by the largest magnitude). A probe:
the written file has no rows, so the README's tables never show it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # schedlang from this checkout, uninstalled
import harness  # noqa: E402  (bench/harness.py)

#: (experts, hidden, moe_intermediate, top_k, tokens, dtype)
FULL = dict(experts=128, hidden=2048, intermediate=768, top_k=8, tokens=8192, dtype=torch.bfloat16)
TINY = dict(experts=6, hidden=32, intermediate=16, top_k=2, tokens=12, dtype=torch.float32)
#: error bound relative to the largest magnitude of the family's tensor
TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


def _experts(shape: dict, device: torch.device):
    import transformers as T

    config = T.Qwen3MoeConfig(hidden_size=shape["hidden"], moe_intermediate_size=shape["intermediate"],
                              num_experts=shape["experts"], num_experts_per_tok=shape["top_k"], num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=4, head_dim=8, vocab_size=64)
    experts = T.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return experts.to(device, shape["dtype"])


def _routing(shape: dict, device: torch.device):
    """Tokens, their top-k experts (skewed: the router's softmax over random logits) and weights, and a cotangent.
    Expert 0 is chosen by no token, as happens in a real batch."""
    g = torch.Generator().manual_seed(1)
    t, k, e, h = shape["tokens"], shape["top_k"], shape["experts"], shape["hidden"]
    logits = torch.randn(t, e, generator=g) * 2 + torch.linspace(0, 1, e)
    logits[:, 0] = -1e9
    weights, index = torch.softmax(logits, -1).topk(k, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    hidden = torch.randn(t, h, generator=g)
    cotangent = torch.randn(t, h, generator=g)
    dtype = shape["dtype"]
    return hidden.to(device, dtype), index.to(device), weights.to(device, dtype), cotangent.to(device, dtype)


def grouped_forward(experts, hidden, index, weights, backend: str):
    """The family's experts forward, computed with the grouped products: rows sorted by expert, weighted, summed."""
    from schedlang.kernels.grouped_gemm_experts import grouped_experts_forward

    tokens, k = index.shape
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.gate_up_proj.shape[0])
    token = order // k
    out = grouped_experts_forward(experts, hidden.index_select(0, token), counts, backend=backend)
    out = out * weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(hidden).index_add(0, token, out)


def _ways(device: torch.device, experts, hidden) -> Dict[str, Callable]:
    from schedlang.kernels.grouped_gemm import torch_grouped_mm_supports

    ways = {"family_loop": lambda h, i, w: experts(h, i, w),
            "triton": lambda h, i, w: grouped_forward(experts, h, i, w, "triton")}
    if torch_grouped_mm_supports(hidden, experts.gate_up_proj):
        ways["torch_grouped_mm"] = lambda h, i, w: grouped_forward(experts, h, i, w, "torch")
    return ways


def _step(way, experts, hidden, index, weights, cotangent):
    """One forward and backward; returns the output and the gradients (tokens, weights, gate_up, down)."""
    h = hidden.detach().requires_grad_(True)
    w = weights.detach().requires_grad_(True)
    for p in experts.parameters():
        p.grad = None
    out = way(h, index, w)
    out.backward(cotangent)
    return [out.detach(), h.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


def _check(got: List[torch.Tensor], want: List[torch.Tensor], dtype: torch.dtype) -> str:
    for what, a, b in zip(("out", "grad tokens", "grad weights", "grad gate_up_proj", "grad down_proj"), got, want):
        err = (a.float() - b.float()).abs().max().item()
        scale = b.float().abs().max().item()
        if not err <= TOL[dtype] * scale:
            return f"FAIL {what} {err:.3g} > {TOL[dtype]:.0e} * {scale:.3g}"
    return "ok"


def measure(shape: dict, device: torch.device) -> List[dict]:
    experts = _experts(shape, device)
    hidden, index, weights, cotangent = _routing(shape, device)
    rows = shape["tokens"] * shape["top_k"]
    flops = 3 * 2 * rows * 3 * shape["hidden"] * shape["intermediate"]
    want = None
    out = []
    for name, way in _ways(device, experts, hidden).items():
        got = _step(way, experts, hidden, index, weights, cotangent)
        want = want or got
        call = lambda: _step(way, experts, hidden, index, weights, cotangent)  # noqa: E731
        ms = harness.call_time_ms(call, device, repeats=10, warmup=2)
        row = {"way": name, "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "rows": rows,
               "check": _check(got, want, shape["dtype"])}
        out.append(row)
        print(row, flush=True)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", default=None, help="where the JSON goes (default: bench/results)")
    parser.add_argument("--tiny", action="store_true", help="a tiny layer in the interpreter on the CPU")
    args = parser.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, shape = torch.device("cpu"), TINY
    else:
        device, shape = torch.device("cuda"), FULL
    results = measure(shape, device)
    probe = {"layer": {k: str(v).replace("torch.", "") if k == "dtype" else v for k, v in shape.items()},
             "ways": {"family_loop": "transformers Qwen3MoeExperts.forward (eager)",
                      "triton": "schedlang.kernels.grouped_gemm (Triton)",
                      "torch_grouped_mm": "torch._grouped_mm"},
             "results": results}
    harness.write_probe("grouped-gemm", probe, gpus=0 if args.tiny else 1, results_dir=args.results_dir)
    return probe


if __name__ == "__main__":
    main()

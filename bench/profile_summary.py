"""Where a training step's GPU time goes: a torch.profiler Chrome trace summarized by kernel kind.

    python bench/profile_summary.py traces/llama-1.1b-1gpu-titan-style.json traces/...-schedlang-optimize.json \
        --steps 3 --out bench/results/2026-11-25-profile-llama-1.1b-1gpu.json

``bench_train.py --profile DIR`` writes the traces (3 steps per variant); this reads them and gives,
per step: the wall time the trace spans, the time the GPU was busy (the union of kernel intervals,
so overlapping streams count once) and so the idle share (host-bound time), and the kernel time
by kind:

* ``gemm``: cuBLAS / CUTLASS / nvJet matrix multiplies (also float8 scaled ones);
* ``attention``: flash / cuDNN / memory-efficient attention, forward and backward;
* ``optimizer``: the fused or foreach optimizer step (``multi_tensor_apply``, fused Adam);
* ``inductor``: Triton kernels TorchInductor generated (``triton_poi_``, ``triton_red_``, ...);
* ``schedlang``: schedlang's own Triton kernels (RMSNorm, rotary, SwiGLU, linear + cross entropy);
* ``cast_copy``: eager dtype casts and copies (``copy_`` / ``_to_copy`` kernels, ``cat``);
* ``eager_elementwise`` and ``eager_reduce``: other eager ATen kernels;
* ``collective``: NCCL;  ``memset``;  ``other``.

The output keeps the 25 kernels that took longest (name, kind, calls and ms per step), so that two
variants' profiles can be compared line by line. The trace itself is not kept (tens of MB).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

KINDS: Tuple[Tuple[str, re.Pattern], ...] = tuple((kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in (
    ("collective", r"nccl"),
    ("attention", r"flash|fmha|cudnn.*(sdpa|attn|attention)|sdpa|attention|mha_|cutlass.*Attention"),
    ("optimizer", r"multi_tensor|fused_adam|adam|_fused_sgd|FusedOptimizer"),
    ("schedlang", r"^_(rms_norm|rotary|swiglu|fused_linear_cross_entropy|flce|adam|sgd|multi_tensor)\w*kernel"),
    ("gemm", r"^triton_tem_"),  # Inductor's matmul templates
    ("inductor", r"^triton_"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_.*(mma|wgmma)|scaled_mm|\bmm_|matmul|splitK"),
    ("memset", r"memset|fill_kernel|FillFunctor"),
    ("cast_copy", r"copy|_to_copy|CatArray|cat_|direct_copy"),
    ("eager_reduce", r"reduce_kernel|Reduce|softmax|norm_kernel|cross_entropy|nll_loss|log_softmax"),
    ("eager_elementwise", r"elementwise|vectorized|unrolled|index|gather|scatter|embedding"),
))


def kind_of(kernel_name: str) -> str:
    """The kind a kernel's name says it is (see the module docstring); ``"other"`` if none."""
    for kind, pattern in KINDS:
        if pattern.search(kernel_name):
            return kind
    return "other"


def _busy_us(intervals: List[Tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s >= end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(trace_path: Path, steps: int, top: int = 25) -> Dict:
    """The per-step summary of one Chrome trace written by ``torch.profiler`` (see the module docstring)."""
    events = json.loads(Path(trace_path).read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        raise ValueError(f"{trace_path}: no GPU kernels in the trace (was it recorded with CUDA activity?)")
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kernels]
    by_kind: Dict[str, float] = defaultdict(float)
    by_name: Dict[str, List[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        name = e.get("name", "?")
        kind = "memset" if e["cat"] == "gpu_memset" else "cast_copy" if e["cat"] == "gpu_memcpy" else kind_of(name)
        by_kind[kind] += float(e.get("dur", 0))
        by_name[name][0] += 1
        by_name[name][1] += float(e.get("dur", 0))
    first, last = min(s for s, _ in intervals), max(e for _, e in intervals)
    busy = _busy_us(intervals)
    kernel_total = sum(by_kind.values())
    per_step = 1e-3 / steps  # us over all steps -> ms per step
    top_rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "trace": Path(trace_path).name,
        "steps": steps,
        "span_ms": round((last - first) * per_step, 3),
        "gpu_busy_ms": round(busy * per_step, 3),
        "idle_share": round(1 - busy / (last - first), 4) if last > first else 0.0,
        "kernel_ms": round(kernel_total * per_step, 3),
        "launches_per_step": round(len(kernels) / steps, 1),
        "by_kind_ms": {k: round(v * per_step, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "kind": kind_of(n), "calls": round(c / steps, 1),
                         "ms": round(t * per_step, 3)} for n, (c, t) in top_rows],
    }


def markdown(summaries: Sequence[Dict]) -> str:
    """The summaries side by side: one column per trace, one row per kind."""
    kinds = sorted({k for s in summaries for k in s["by_kind_ms"]},
                   key=lambda k: -max(s["by_kind_ms"].get(k, 0.0) for s in summaries))
    head = ["ms per step"] + [s["trace"] for s in summaries]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    for label, key in (("trace span", "span_ms"), ("GPU busy", "gpu_busy_ms"), ("kernel sum", "kernel_ms"),
                       ("launches", "launches_per_step")):
        lines.append(f"| {label} | " + " | ".join(str(s[key]) for s in summaries) + " |")
    for k in kinds:
        lines.append(f"| {k} | " + " | ".join(str(s["by_kind_ms"].get(k, 0.0)) for s in summaries) + " |")
    return "\n".join(lines)


def main(argv=None) -> List[Dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+", help="Chrome traces from bench_train.py --profile")
    parser.add_argument("--steps", type=int, default=3, help="steps each trace holds")
    parser.add_argument("--top", type=int, default=25, help="longest kernels kept per trace")
    parser.add_argument("--out", default=None, help="write the summaries here as JSON (with --meta fields)")
    parser.add_argument("--meta", default=None, help="JSON object merged into the output (sha, device, ...)")
    args = parser.parse_args(argv)
    summaries = [summarize(Path(t), args.steps, args.top) for t in args.traces]
    print(markdown(summaries))
    if args.out:
        meta = json.loads(args.meta) if args.meta else {}
        Path(args.out).write_text(json.dumps({**meta, "profiles": summaries}, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return summaries


if __name__ == "__main__":
    main()

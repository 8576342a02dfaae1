"""Horizontal fusion, combined sparse features: schedlang against eager, torch.compile and hand rewrites.

Cases (the seed posts' micro-patterns, sizes as in the reference figures):

* split -> LayerNorm -> tanh -> cat over N=50 features of width D=64, batch 2048, fp32:
  eager chain (2N + 2 kernels), ``torch.compile`` of the chain, the hand-written
  ``(B, N, D)`` rewrite, and the model that ``horizontal_fuse`` makes from the traced chain
  (alone and under ``torch.compile``);
* 32 parallel ``Linear(256, 64)`` on one input, batch 2048, bf16: separate linears, the
  hand-written one-GEMM rewrite, ``torch.compile`` of the separate linears, and the
  ``horizontal_fuse`` model (alone, under ``torch.compile``, and replayed as a CUDA graph);
* 1000 sparse features (512 indices and 128 lengths each) host to device: 2N pinned copies
  against the 2 copies of the pair from ``schedlang.sparse.combine_sparse_features``; the
  host-side combine and the device-side split (lazy; with its offsets; with the N per-feature
  pairs read) are timed separately. Then a model pooling each feature with its own
  ``EmbeddingBag(1000, 16)``: alone on device inputs, and end to end (host tensors in, the
  ``(B, N*16)`` output ready on the device, wall clock) as 2N copies + N EmbeddingBags, as
  combine + 2 copies + split + N EmbeddingBags (the ``combine_sparse_features`` primitive only),
  and as combine + 2 copies + one lookup (then ``horizontal_fuse``'s ``embedding_bags`` rule),
  with and without the host combine; each checked against the 2N-copies output first;
* ``horizontal_fuse`` itself on a traced graph of 10,000 nodes (CPU time).

Forward passes without gradients, as in the reference figures. GPU times are medians of
``triton.testing.do_bench`` (which clears the L2 cache before every call, so inputs are not
served from cache); "host" is the time to enqueue one call (CPU), which bounds a
launch-bound model from below.

Usage: python bench/bench_horizontal.py [--out results.md]

Rows also go to ``bench/results/<date>-horizontal.json`` (``bench/harness.py``), each against the
first (baseline) row of its case, for the README.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/harness.py)

import schedlang  # noqa: E402
from schedlang.graph.passes.horizontal import horizontal_fuse  # noqa: E402
from schedlang.sparse import combine_sparse_features, split_sparse_features  # noqa: E402

DEV = "cuda"
ROWS = []


def log(msg):
    print(msg, flush=True)


def timed(fn, host_calls=50):
    """(median GPU ms, first-call seconds, host ms per call)."""
    from triton.testing import do_bench

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(host_calls):
        fn()
    host = (time.perf_counter() - t0) / host_calls * 1e3
    torch.cuda.synchronize()
    return ms, first, host


def row(case, variant, ms, first, host, ref=None, target=None):
    ROWS.append(dict(case=case, variant=variant, ms=ms, first=first, host=host, ref=ref, target=target))
    ratio = "" if ref is None else f"  x{ref / ms:.2f} vs eager"
    tgt = "" if target is None else f"  target <= {target} ms: {'met' if ms <= target else 'MISSED'}"
    log(f"{case:34s} {variant:34s} {ms:8.4f} ms  first {first:6.2f}s  host {host:7.4f} ms{ratio}{tgt}")


def fused_model(model, example):
    """The schedlang version: trace the model, run horizontal_fuse, return the module and report."""
    sch = schedlang.create_schedule(model)
    try:
        sch.trace()
    except schedlang.TraceError as e:  # keep benchmarking the rules if the hierarchy-keeping tracer fails
        log(f"sch.trace() failed ({e}); tracing with torch.fx.symbolic_trace instead")
        sch._set_module(torch.fx.symbolic_trace(sch.mod))
    report = sch.horizontal_fuse()
    return sch.mod, report


# ----------------------------------------------------------------------------- 1. split-LN-tanh-cat
class SplitLayerNormTanhCat(nn.Module):
    def __init__(self, n, d):
        super().__init__()
        self.d = d
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))

    def forward(self, x):
        pieces = x.split(self.d, -1)
        return torch.cat([torch.tanh(norm(pieces[i])) for i, norm in enumerate(self.norms)], -1)


def bench_split_layer_norm(n=50, d=64, b=2048):
    case = f"split-LN-tanh-cat N={n} D={d} B={b}"
    torch.manual_seed(0)
    model = SplitLayerNormTanhCat(n, d).to(DEV)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0, 0.3)
    x = torch.randn(b, n * d, device=DEV)
    wt = torch.stack([m.weight for m in model.norms]).detach()
    bs = torch.stack([m.bias for m in model.norms]).detach()

    def hand(x):
        y = F.layer_norm(x.view(b, n, d), (d,)) * wt + bs
        return torch.tanh(y).view(b, n * d)

    fused, report = fused_model(copy.deepcopy(model), x)
    log(str(report).splitlines()[0])
    variants = {"eager chain": model, "torch.compile chain": torch.compile(model), "hand (B,N,D) rewrite": hand,
                "schedlang horizontal_fuse": fused, "schedlang + torch.compile": torch.compile(fused)}
    with torch.no_grad():
        ref = model(x)
        for label, f in variants.items():
            torch.testing.assert_close(f(x), ref, rtol=1e-4, atol=1e-4)
        eager = None
        for label, f in variants.items():
            ms, first, host = timed(lambda f=f: f(x))
            eager = ms if eager is None else eager
            row(case, label, ms, first, host, None if label == "eager chain" else eager,
                0.21 if label.startswith("schedlang") else None)


# ----------------------------------------------------------------------------- 2. parallel linears
class ParallelLinears(nn.Module):
    def __init__(self, n, d_in, d_out):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(d_in, d_out) for _ in range(n))

    def forward(self, x):
        return tuple(lin(x) for lin in self.linears)


def cuda_graph(fn, x):
    """Replay ``fn(x)`` (same input buffer) as one CUDA graph launch."""
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static_x)

    def run(x_new):
        static_x.copy_(x_new)
        graph.replay()
        return out

    return run


def bench_parallel_linears(n=32, d_in=256, d_out=64, b=2048):
    case = f"{n} parallel linears {d_in}->{d_out} b{b} bf16"
    torch.manual_seed(0)
    model = ParallelLinears(n, d_in, d_out).to(DEV, torch.bfloat16)
    x = torch.randn(b, d_in, device=DEV, dtype=torch.bfloat16)
    w = torch.cat([m.weight for m in model.linears]).detach()
    bias = torch.cat([m.bias for m in model.linears]).detach()

    def hand(x):
        return F.linear(x, w, bias).split(d_out, -1)

    fused, report = fused_model(copy.deepcopy(model), x)
    log(str(report).splitlines()[0])
    variants = {"separate linears (eager)": model, "torch.compile separate": torch.compile(model),
                "hand one-GEMM rewrite": hand, "schedlang horizontal_fuse": fused,
                "schedlang + torch.compile": torch.compile(fused)}
    with torch.no_grad():
        variants["schedlang + CUDA graph"] = cuda_graph(fused, x)
        ref = model(x)
        for label, f in variants.items():
            for a, e in zip(f(x), ref):
                torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-2)
        eager = None
        for label, f in variants.items():
            ms, first, host = timed(lambda f=f: f(x))
            eager = ms if eager is None else eager
            row(case, label, ms, first, host, None if label == "separate linears (eager)" else eager,
                0.012 if label.startswith("schedlang") else None)


# ----------------------------------------------------------------------------- 3. sparse features
def many_bags_model(n, rows, dim, mode="sum"):
    """A recommendation model's pooling: N sparse features ``(i<k>, l<k>)``, each by its own EmbeddingBag.

    Written out for N named inputs (as a user's model with N features would be), so tracing gives one
    placeholder per tensor and ``combine_sparse_features`` can name them.
    """
    names = ", ".join(f"i{k}, l{k}" for k in range(n))
    pairs = ", ".join(f"(i{k}, l{k})" for k in range(n))
    namespace = {}
    exec(f"def forward(self, {names}):\n    return self.pool([{pairs}])\n", namespace)

    class ManyBags(nn.Module):
        def __init__(self):
            super().__init__()
            self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode=mode) for _ in range(n))

        def pool(self, pairs):
            out = [bag(i, torch.cat([lens.new_zeros(1), lens.cumsum(0)[:-1]])) for bag, (i, lens) in zip(self.bags, pairs)]
            return torch.cat(out, -1)

        forward = namespace["forward"]

    return ManyBags()


def sparse_batch(n, n_idx, batch, rows, pin):
    """N features of ``n_idx`` indices each, split at random among ``batch`` samples (some empty)."""
    gen = torch.Generator().manual_seed(0)
    features = []
    for _ in range(n):
        cuts = torch.sort(torch.randint(0, n_idx + 1, (batch - 1,), generator=gen)).values
        lens = torch.diff(cuts, prepend=torch.tensor([0]), append=torch.tensor([n_idx]))
        idx = torch.randint(0, rows, (n_idx,), generator=gen)
        features.append((idx.pin_memory(), lens.pin_memory()) if pin else (idx, lens))
    return features


def sparse_models(n, rows, dim):
    """(model with N EmbeddingBags, the same taking the combined pair, the same after horizontal_fuse)."""
    from schedlang.graph.passes.combine_sparse_features import combine_sparse_inputs

    torch.manual_seed(0)
    model = many_bags_model(n, rows, dim).to(DEV)
    combined = torch.fx.symbolic_trace(model)
    combine_sparse_inputs(combined, [(f"i{k}", f"l{k}") for k in range(n)])
    fused = copy.deepcopy(combined)
    report = horizontal_fuse(fused)
    return model, combined, fused, report


def bench_sparse(n=1000, n_idx=512, batch=128, rows=1000, dim=16):
    case = f"H2D sparse features N={n}"
    pin = DEV == "cuda"
    features = sparse_batch(n, n_idx, batch, rows, pin)
    flat = [t for pair in features for t in pair]

    def many():
        return [t.to(DEV, non_blocking=True) for t in flat]

    indices, lengths = combine_sparse_features(features, pin_memory=pin)

    def combined():
        return indices.to(DEV, non_blocking=True), lengths.to(DEV, non_blocking=True)

    ms_many, first, host = timed(many)
    row(case, "2N copies", ms_many, first, host)
    ms, first, host = timed(combined)
    row(case, "schedlang combined (2 copies)", ms, first, host, ms_many, 0.11)
    # what the combined pair costs around the copy: on the host, and on the device
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        combine_sparse_features(features, pin_memory=pin)
        t.append((time.perf_counter() - t0) * 1e3)
    log(f"{case:34s} {'host: combine_sparse_features':34s} {statistics.median(t):8.4f} ms (CPU, median of 5)")
    ROWS.append(dict(case=case, variant="host: combine_sparse_features (CPU)", ms=statistics.median(t), first=0,
                     host=statistics.median(t), ref=None, target=None))
    d_idx, d_len = combined()
    back = split_sparse_features(d_idx, d_len, n)
    assert all(torch.equal(a.cpu(), i) and torch.equal(l.cpu(), c) for (a, l), (i, c) in zip(back, features))
    # the split as a model meets it: lazy (nothing waits), with the device offsets a consumer of the
    # combined form reads, and with the N per-feature pairs read (one device-to-host copy + 2N views)
    ms, first, host = timed(lambda: split_sparse_features(d_idx, d_len, n))
    row(case, "device: split_sparse_features (lazy)", ms, first, host, None, 0.05)
    ms, first, host = timed(lambda: split_sparse_features(d_idx, d_len, n).offsets)
    row(case, "device: split + offsets (cumsum)", ms, first, host, None, 0.05)
    ms, first, host = timed(lambda: split_sparse_features(d_idx, d_len, n).pieces())
    row(case, "device: split + N per-feature pairs", ms, first, host)

    # end to end, as a training step sees it: host tensors in, pooled (B, N*D) embeddings out, wall clock
    # until the output is ready on the device
    model, model_combined, model_fused, report = sparse_models(n, rows, dim)
    log(str(report).splitlines()[0] + f"; {report.counts}")
    assert report.counts.get("embedding_bags") == 1, report.counts
    with torch.no_grad():
        ref = model(*many())
        torch.testing.assert_close(model_combined(*combined()), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model_fused(*combined()), ref, rtol=1e-5, atol=1e-5)
        # the models alone, inputs already on the device
        case_model = f"sparse N={n} -> EmbeddingBag D={dim} model"
        d_flat, d_pair = many(), combined()
        ms_ref, first, host = timed(lambda: model(*d_flat))
        row(case_model, "N EmbeddingBags (eager, device inputs)", ms_ref, first, host)
        ms, first, host = timed(lambda: model_combined(*d_pair))
        row(case_model, "schedlang split + N EmbeddingBags (device inputs)", ms, first, host, ms_ref)
        ms, first, host = timed(lambda: model_fused(*d_pair))
        row(case_model, "schedlang fused lookup (device inputs)", ms, first, host, ms_ref)

        def sync():
            if DEV == "cuda":
                torch.cuda.synchronize()

        def e2e_many():
            out = model(*many())
            sync()
            return out

        def e2e_split():
            i, l = combine_sparse_features(features, pin_memory=pin)
            out = model_combined(i.to(DEV, non_blocking=True), l.to(DEV, non_blocking=True))
            sync()
            return out

        def e2e_fused():
            i, l = combine_sparse_features(features, pin_memory=pin)
            out = model_fused(i.to(DEV, non_blocking=True), l.to(DEV, non_blocking=True))
            sync()
            return out

        def e2e_fused_precombined():
            out = model_fused(indices.to(DEV, non_blocking=True), lengths.to(DEV, non_blocking=True))
            sync()
            return out

        case_e2e = case_model + " end to end"
        for fn in (e2e_split, e2e_fused, e2e_fused_precombined):
            torch.testing.assert_close(fn(), ref, rtol=1e-5, atol=1e-5)
        ms_ref = wall_ms(e2e_many)
        row(case_e2e, "2N copies + N EmbeddingBags (wall)", ms_ref, 0.0, ms_ref)
        ms = wall_ms(e2e_split)
        row(case_e2e, "schedlang combine + 2 copies + split + N EmbeddingBags (wall)", ms, 0.0, ms, ms_ref)
        ms = wall_ms(e2e_fused)
        row(case_e2e, "schedlang combine + 2 copies + fused lookup (wall)", ms, 0.0, ms, ms_ref, 1.0)
        ms = wall_ms(e2e_fused_precombined)
        row(case_e2e, "schedlang 2 copies + fused lookup, combined by the input pipeline (wall)", ms, 0.0, ms,
            ms_ref, 1.0)


def wall_ms(fn, repeats=21):
    """Median wall-clock milliseconds of ``fn`` (which waits for the GPU itself), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(t)


# ----------------------------------------------------------------------------- 4. fusion time
class ManyBranchBlocks(nn.Module):
    def __init__(self, blocks, n=4, d=4):
        super().__init__()
        self.linears = nn.ModuleList(nn.ModuleList(nn.Linear(n * d, d) for _ in range(n)) for _ in range(blocks))
        self.norms = nn.ModuleList(nn.ModuleList(nn.LayerNorm(d) for _ in range(n)) for _ in range(blocks))

    def forward(self, x):
        for lins, norms in zip(self.linears, self.norms):
            x = torch.cat([torch.relu(norm(lin(x))) for lin, norm in zip(lins, norms)], -1) + x
        return x


def bench_fusion_time(blocks=715):
    gm = torch.fx.symbolic_trace(ManyBranchBlocks(blocks))
    nodes = len(gm.graph.nodes)
    times = []
    for _ in range(3):
        work = copy.deepcopy(gm)
        t0 = time.perf_counter()
        report = horizontal_fuse(work)
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    case = f"horizontal_fuse on {nodes} nodes"
    log(f"{case:34s} {'CPU time':34s} {ms:8.1f} ms  ({len(report)} rewrites, {report.nodes_before} -> "
        f"{report.nodes_after} nodes, {report.sweeps} sweeps)  target < 5000 ms: "
        f"{'met' if ms < 5000 else 'MISSED'}")
    ROWS.append(dict(case=case, variant="horizontal_fuse (CPU)", ms=ms, first=0, host=ms, ref=None, target=5000))


def write_markdown(path, header):
    lines = [header, "", "| case | variant | GPU ms (median) | host ms/call | x vs baseline | target |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in ROWS:
        ratio = "" if r["ref"] is None else f"x{r['ref'] / r['ms']:.2f}"
        target = "" if r["target"] is None else f"<= {r['target']} ({'met' if r['ms'] <= r['target'] else 'missed'})"
        lines.append(f"| {r['case']} | {r['variant']} | {r['ms']:.4f} | {r['host']:.4f} | {ratio} | {target} |")
    Path(path).write_text("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import triton

    header = (f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
              f"{datetime.date.today().isoformat()}")
    log(header)
    bench_split_layer_norm()
    bench_parallel_linears()
    bench_sparse()
    bench_fusion_time()
    if args.out:
        write_markdown(args.out, header)
    log(f"wrote {write_json()}")


def write_json():
    """The rows in the format of ``bench/harness.py`` (each against the case's eager or many-copy row)."""
    rows = []
    for case in dict.fromkeys(r["case"] for r in ROWS):
        group = [r for r in ROWS if r["case"] == case]
        base = group[0]["variant"]
        for r in group:
            role = "schedlang" if r["variant"].startswith(("schedlang", "host:", "device:", "horizontal_fuse")) \
                else "baseline"
            extra = {"target_ms": r["target"]} if r["target"] is not None else {}
            rows.append(harness.micro_row(case, r["variant"], role, r["ms"], baseline=base,
                                          first_call_s=round(r["first"], 3), host_ms=round(r["host"], 4), **extra))
    return harness.write_results("horizontal", rows, gpus=1)


if __name__ == "__main__":
    main()

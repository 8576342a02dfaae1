"""AdamW step over GPT-2-medium-like parameters: torch.optim variants against schedlang's kernel.

445 fp32 tensors, (1024, 1024) x 96 + (4096, 1024) x 48 + (1024,) x 300 + (50304, 1024): 354M
elements, 1.4 GB of parameters. An AdamW step reads p, g, m, v and writes p, m, v: 7 passes of
fp32, so its floor is ``7 * bytes / copy bandwidth``, with the bandwidth measured here by a large
device-to-device copy (bytes read + bytes written over its time).

Rows, all in this one process on one GPU: torch.optim.AdamW single-tensor, foreach, fused (CUDA),
torch.compile'd foreach (capturable, tensor lr), then schedlang's FusedAdamW eager and replayed
from a captured CUDA graph. Each row gives the median step time (triton.testing.do_bench, which
flushes L2 before each call), its ratio to every baseline, and its first-step time (the first
``step()`` after construction, compilation included; Triton's cache is cold when the script is
run with an empty TRITON_CACHE_DIR). Extra rows: bf16 parameters with fp32 state, and SGD with
momentum against torch's fused SGD.

Usage: python bench/bench_optim.py [--sweep] [--skip-compiled] [--out results.md]

Rows also go to ``bench/results/<date>-optim.json`` (``bench/harness.py``), from which the README's
table is rendered: work ``adamw-445-tensors`` (each row against ``torch fused (CUDA)``; the first step
in ``first_step_s``), and ``adamw-bf16-params`` / ``sgd-momentum`` for the other variants.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/harness.py)

SHAPES = [(1024, 1024)] * 96 + [(4096, 1024)] * 48 + [(1024,)] * 300 + [(50304, 1024)]
DEV = "cuda"
ROWS = []


def log(msg):
    print(msg, flush=True)


def copy_bandwidth():
    from triton.testing import do_bench

    src = torch.randn(1 << 29, device=DEV)  # 2 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=100, rep=500, return_mode="median")
    del src, dst
    return 2 * (1 << 29) * 4 / (ms * 1e-3)


def make_params(dtype=torch.float32, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    params = []
    for s in SHAPES:
        p = torch.randn(s, device=DEV, generator=g).to(dtype).requires_grad_(True)
        p.grad = torch.randn(s, device=DEV, generator=g).to(dtype)
        params.append(p)
    return params


def first_step_and_bench(make_opt, step_of=None):
    from triton.testing import do_bench

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt = make_opt()
    step = step_of(opt) if step_of else opt.step
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    ms = do_bench(step, warmup=100, rep=1000, return_mode="median")
    return ms, first, opt


def captured_step(opt):
    """Warm up on a side stream, capture one step in a CUDA graph, return its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph.replay


def bench_adamw(args, bandwidth):
    import schedlang.kernels.multi_tensor_adam as mta
    from schedlang.optim import FusedAdamW

    nbytes = sum(torch.Size(s).numel() for s in SHAPES) * 4
    floor_ms = 7 * nbytes / bandwidth * 1e3
    log(f"AdamW fp32: {len(SHAPES)} tensors, {nbytes / 1e6:.0f} MB of parameters, floor {floor_ms:.3f} ms")
    base = make_params()

    def clone_params(dtype=torch.float32):
        ps = []
        for p in base:
            q = p.detach().to(dtype).clone().requires_grad_(True)
            q.grad = p.grad.to(dtype).clone()
            ps.append(q)
        return ps

    # first step with a cold Triton cache (default launch configuration, compilation included),
    # then correctness on the real shapes: 3 steps of ours against torch's fused kernel
    ours_p, ref_p = clone_params(), clone_params()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ours = FusedAdamW(ours_p, lr=torch.tensor(1e-3, device=DEV), weight_decay=0.01)
    ours.step()
    torch.cuda.synchronize()
    cold_first = time.perf_counter() - t0
    log(f"FusedAdamW first step, cold cache: {cold_first:.2f} s")
    ref = torch.optim.AdamW(ref_p, lr=1e-3, weight_decay=0.01, fused=True)
    ref.step()
    for _ in range(2):
        ours.step()
        ref.step()
    err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours_p, ref_p))
    log(f"max relative difference to torch fused after 3 steps: {err:.2e}")
    del ours_p, ref_p, ours, ref
    torch.cuda.empty_cache()

    sweep = []
    if args.sweep:
        configs = [(16384, 1024, 4), (131072, 4096, 16), (65536, 1024, 4), (32768, 2048, 8),
                   (8192, 1024, 4), (16384, 2048, 8), (16384, 1024, 4)]
        default = dict(mta.DEFAULT_CONFIG)
        best = None
        for chunk, block, warps in configs:
            mta.DEFAULT_CONFIG.update(chunk_size=chunk, block_size=block, num_warps=warps)
            ps = clone_params()
            ms, first, opt = first_step_and_bench(lambda: FusedAdamW(ps, lr=torch.tensor(1e-3, device=DEV)))
            sweep.append((chunk, block, warps, ms))
            log(f"  config chunk={chunk:6d} block={block:5d} warps={warps:2d}: {ms:.3f} ms")
            if best is None or ms < best[3]:
                best = (chunk, block, warps, ms)
            del ps, opt
            torch.cuda.empty_cache()
        mta.DEFAULT_CONFIG.update(default if args.keep_default else
                                  dict(chunk_size=best[0], block_size=best[1], num_warps=best[2]))
    log(f"launch config used: {mta.DEFAULT_CONFIG}")

    results = {}
    variants = [("torch single-tensor", dict(foreach=False)), ("torch foreach", dict(foreach=True)),
                ("torch fused (CUDA)", dict(fused=True))]
    if not args.skip_compiled:
        variants.append(("torch.compile foreach (capturable)", dict(foreach=True, capturable=True)))
    for name, kw in variants:
        ps = clone_params()
        compiled = "compile" in name
        lr = torch.tensor(1e-3, device=DEV) if compiled else 1e-3
        ms, first, opt = first_step_and_bench(
            lambda: torch.optim.AdamW(ps, lr=lr, **kw),
            (lambda o: torch.compile(o.step)) if compiled else None)
        results[name] = (ms, first)
        log(f"{name:40s} {ms:8.3f} ms  first step {first:6.2f} s")
        del ps, opt
        torch.cuda.empty_cache()
        if compiled:
            torch._dynamo.reset()

    ps = clone_params()
    ms, first, opt = first_step_and_bench(lambda: FusedAdamW(ps, lr=torch.tensor(1e-3, device=DEV)))
    results["schedlang FusedAdamW eager"] = (ms, cold_first)
    log(f"{'schedlang FusedAdamW eager':40s} {ms:8.3f} ms  first step {first:6.2f} s")
    from triton.testing import do_bench

    replay = captured_step(opt)
    lr = opt.param_groups[0]["lr"]
    for value in (5e-4, 2e-4):  # lr changes between replays go through the tensor
        lr.fill_(value)
        replay()
    ms_graph = do_bench(replay, warmup=100, rep=1000, return_mode="median")
    results["schedlang FusedAdamW CUDA graph"] = (ms_graph, float("nan"))
    log(f"{'schedlang FusedAdamW CUDA graph':40s} {ms_graph:8.3f} ms")
    del ps, opt, replay
    torch.cuda.empty_cache()

    extra = []
    # bf16 parameters and gradients, fp32 state: 2+2 bytes read/written for p, 2 read for g, 16 for m, v
    nel = nbytes // 4
    floor_bf16 = nel * (2 + 2 + 2 + 4 * 4) / bandwidth * 1e3
    ps = clone_params(torch.bfloat16)
    ms, first, opt = first_step_and_bench(lambda: FusedAdamW(ps, lr=torch.tensor(1e-3, device=DEV)))
    extra.append(("schedlang FusedAdamW bf16 params, fp32 state", ms, floor_bf16, first))
    log(f"bf16 params: {ms:.3f} ms (floor {floor_bf16:.3f})")
    del ps, opt
    ps = clone_params(torch.bfloat16)
    ms, first, opt = first_step_and_bench(lambda: torch.optim.AdamW(ps, lr=1e-3, fused=True))
    extra.append(("torch fused AdamW bf16 params, bf16 state", ms, nel * 14 / bandwidth * 1e3, first))
    del ps, opt
    torch.cuda.empty_cache()
    # SGD with momentum: read p, g, b and write p, b
    from schedlang.optim import FusedSGD

    floor_sgd = 5 * nbytes / bandwidth * 1e3
    for name, make in (("torch fused SGD momentum", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, fused=True)),
                       ("schedlang FusedSGD momentum", lambda ps: FusedSGD(ps, lr=1e-3, momentum=0.9))):
        ps = clone_params()
        ms, first, opt = first_step_and_bench(lambda: make(ps))
        extra.append((name, ms, floor_sgd, first))
        log(f"{name}: {ms:.3f} ms (floor {floor_sgd:.3f})")
        del ps, opt
        torch.cuda.empty_cache()
    return dict(results=results, cold_first=cold_first, floor_ms=floor_ms, nbytes=nbytes, sweep=sweep,
                extra=extra, err=err, config=dict(mta.DEFAULT_CONFIG))


def report(r, bandwidth, argv):
    import triton

    lines = [
        f"# AdamW step, 445 tensors (GPT-2 medium shapes), {datetime.date.today().isoformat()}",
        "",
        f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}.",
        f"Command: `TRITON_CACHE_DIR=$(mktemp -d) python bench/bench_optim.py {' '.join(argv)}` "
        "(Triton's cache starts empty, so first-step times include compilation).",
        "",
        f"Measured copy bandwidth (2 GiB device-to-device copy, read + write): {bandwidth / 1e12:.2f} TB/s.",
        f"Parameters: {r['nbytes'] / 1e6:.0f} MB fp32. Memory floor of AdamW (7 fp32 passes over the copy "
        f"bandwidth): **{r['floor_ms']:.3f} ms**.",
        f"Max relative difference of FusedAdamW to torch's fused AdamW after 3 steps: {r['err']:.1e}.",
        f"Launch configuration: {r['config']}.",
        "",
    ]
    names = list(r["results"])
    baselines = [n for n in names if n.startswith("torch")]
    head = "| variant | median ms | x floor | first step (s) | " + " | ".join(f"vs {b}" for b in baselines) + " |"
    lines += [head, "|" + " --- |" * (4 + len(baselines))]
    for n in names:
        ms, first = r["results"][n]
        ratios = " | ".join(f"{r['results'][b][0] / ms:.2f}x" for b in baselines)
        first_s = "-" if first != first else f"{first:.2f}"
        lines.append(f"| {n} | {ms:.3f} | {ms / r['floor_ms']:.2f} | {first_s} | {ratios} |")
    lines += ["", "Ratios are baseline time / row time (above 1: the row is faster). First step: construction "
              "plus the first `step()`, compilation included; for FusedAdamW it is the very first step of the "
              "run, with Triton's cache empty.", ""]
    lines += ["| other variants | median ms | floor ms | x floor | first step (s) |", "| --- | --- | --- | --- | --- |"]
    for n, ms, floor, first in r["extra"]:
        lines.append(f"| {n} | {ms:.3f} | {floor:.3f} | {ms / floor:.2f} | {first:.2f} |")
    if r["sweep"]:
        lines += ["", "Launch-configuration sweep (FusedAdamW eager, fp32):", "",
                  "| chunk | block | warps | median ms |", "| --- | --- | --- | --- |"]
        lines += [f"| {c} | {b} | {w} | {ms:.3f} |" for c, b, w, ms in r["sweep"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="time several launch configurations first, keep the best")
    ap.add_argument("--keep-default", action="store_true", help="after --sweep, keep the default configuration")
    ap.add_argument("--skip-compiled", action="store_true", help="leave out torch.compile (about 70 s to compile)")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    log(f"{torch.cuda.get_device_name()} copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    r = bench_adamw(args, bandwidth)
    shown = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--out")]
    text = report(r, bandwidth, [a for a in shown if a.startswith("--")])
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)
    log(f"wrote {write_json(r, bandwidth, argv)}")


def write_json(r, bandwidth, argv):
    """The rows in the format of ``bench/harness.py``, for the README."""
    def role(name):
        return "schedlang" if name.startswith("schedlang") else "baseline"

    base = "torch fused (CUDA)"
    rows = [harness.micro_row("adamw-445-tensors", n, role(n), ms, baseline=base, floor_ms=round(r["floor_ms"], 4),
                              first_step_s=None if first != first else round(first, 3), max_rel_err=r["err"])
            for n, (ms, first) in r["results"].items()]
    for n, ms, floor, first in r["extra"]:
        work = "sgd-momentum" if "SGD" in n else "adamw-bf16-params"
        ref = "torch fused SGD momentum" if "SGD" in n else "torch fused AdamW bf16 params, bf16 state"
        rows.append(harness.micro_row(work, n, role(n), ms, baseline=ref, floor_ms=round(floor, 4),
                                      first_step_s=round(first, 3)))
    args = sys.argv[1:] if argv is None else list(argv)
    return harness.write_results("optim", rows, gpus=1, copy_bandwidth_tb_s=round(bandwidth / 1e12, 3),
                                 launch_config=r["config"], command=" ".join(["bench/bench_optim.py"] + args))


if __name__ == "__main__":
    main()

"""Communication/computation overlap: ``sch.overlap_communication()`` against blocking collectives.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    torchrun --nproc_per_node=2 bench/bench_overlap.py [--side-layers 1,2,4] [--reps 100] [--rounds 3]
    torchrun --nproc_per_node=2 bench/bench_overlap.py --cpu --small      # gloo ranks, checks the script

Workload (forward only, ``torch.no_grad``): a block with two branches on the same input ``x``
(``tokens x hidden``, replicated on every rank, as tensor parallelism wants it):

* branch A, a Megatron MLP: ``fc1`` column-parallel (``shard("weight", axis=0)``), GELU, ``fc2``
  row-parallel (``shard("weight", axis=1)``) followed by ``sync("fwd_post", "all_reduce")``, so
  every rank all-reduces a ``tokens x hidden`` partial sum;
* branch B, ``side_layers`` replicated ``hidden x hidden`` linears with GELU, independent of A;
* the output is ``A + B``: the all-reduced value is needed only at the very end.

Variants, all in this one process per rank and all from the same weights:

* ``eager``: the schedule as built (the all-reduce runs from ``fc2``'s forward hook, blocking);
* ``(a) blocking``: the same schedule after ``sch.trace(flatten=True)``;
* ``(b) overlap``: that traced schedule after ``sch.overlap_communication()``: the all-reduce is
  issued right after ``fc2`` (``async_op=True``) and waited for just before the final add, so
  branch B runs while it is in flight;
* ``compute only``: the same sharded schedule without the ``sync`` (wrong numerics, the time
  of the computation alone);
* ``all-reduce only``: the schedule's collective alone (clone of the partial sum + all-reduce of
  ``tokens x hidden``), and a bare ``dist.all_reduce`` of that tensor.

Timing: warm-up, ``dist.barrier()``, then the median of ``--reps`` calls each timed between CUDA
events (on CPU ranks: ``time.perf_counter``). Every rank runs the same fixed number of calls
(``triton.testing.do_bench`` picks its repetition count from a first measurement, which may
differ between ranks and would then deadlock the collectives). Rank 0's figures are reported,
with rank 1's (a)/(b) ratio beside them; the table keeps the best round, the lines under it
every round's median (their spread is the noise to read the table against). The JSON rows
(``bench/results/<date>-overlap.json``, ``bench/harness.py``) give both: ``ms`` is the typical
case (the median round), ``ms_best`` the best one, ``ms_runs`` every round.

Numerics: (a) and (b) must give bitwise equal outputs (the same kernels in another order), and
both must match the unsharded model within bf16 tolerance.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/harness.py)


class TwoBranches(nn.Module):
    """A tensor-parallel MLP and an independent stack of linears on the same input, summed."""

    def __init__(self, hidden: int, inner: int, side_layers: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner, bias=False)
        self.fc2 = nn.Linear(inner, hidden, bias=False)
        self.side = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(side_layers))

    def forward(self, x):
        a = self.fc2(F.gelu(self.fc1(x)))  # all-reduced after fc2 (row-parallel)
        b = x
        for layer in self.side:  # needs nothing from branch A
            b = F.gelu(layer(b))
        return a + b


def make_schedules(model: nn.Module):
    """The four schedules of one model: eager, traced blocking, traced overlapped, compute only."""
    import schedlang

    def sharded(with_sync: bool):
        sch = schedlang.create_schedule(model)
        sch["fc1"].shard("weight", axis=0)
        sch["fc2"].shard("weight", axis=1)
        if with_sync:
            sch["fc2"].sync("fwd_post", "all_reduce")
        return sch

    eager = sharded(True)
    blocking = sharded(True)
    blocking.trace(flatten=True)
    overlap = sharded(True)
    overlap.trace(flatten=True)
    report = overlap.overlap_communication()
    compute = sharded(False)
    return {"eager": eager.mod, "blocking": blocking.mod, "overlap": overlap.mod, "compute": compute.mod}, report


def median_ms(fn, reps: int, warmup: int, cuda: bool) -> float:
    """Median of ``reps`` timed calls of ``fn`` (same call count on every rank)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    dist.barrier()
    return statistics.median(times)


def versions(cuda: bool) -> str:
    parts = [f"torch {torch.__version__}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        parts.append("triton -")
    if cuda:
        nccl = torch.cuda.nccl.version()
        parts.append("NCCL " + (".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)))
        parts.append(f"CUDA {torch.version.cuda}")
        parts.append(f"device {torch.cuda.get_device_name()}")
    else:
        parts.append("gloo on CPU")
    parts.append(f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
    parts.append(f"TORCH_SYMM_MEM_DISABLE_MULTICAST={os.environ.get('TORCH_SYMM_MEM_DISABLE_MULTICAST')}")
    return ", ".join(parts)


def run_case(side_layers: int, args, device, dtype, cuda: bool, rank: int, world: int, show_code: bool):
    torch.manual_seed(0)  # the same weights on every rank
    with torch.device(device):
        model = TwoBranches(args.hidden, args.inner, side_layers).to(dtype)
    models, report = make_schedules(model)
    gen = torch.Generator(device=device).manual_seed(1)  # the same input on every rank
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, generator=gen)
    if show_code and rank == 0:
        print(str(report))
        print("overlapped forward:\n" + models["overlap"].code.strip() + "\n", flush=True)

    with torch.no_grad():
        reference = model(x).float()
        out = {k: models[k](x) for k in ("eager", "blocking", "overlap")}
        scale = reference.abs().max().item()
        check = {
            "a_equals_b": torch.equal(out["blocking"], out["overlap"]),
            "max_diff_a_b": (out["blocking"].float() - out["overlap"].float()).abs().max().item(),
            "eager_equals_a": torch.equal(out["eager"], out["blocking"]),
            "rel_err_vs_unsharded": (out["overlap"].float() - reference).abs().max().item() / scale,
        }
        del out, reference

        partial = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, generator=gen)

        def schedule_collective():  # what the SyncOp does: clone the partial sum, all-reduce the clone
            buf = partial.clone()
            dist.all_reduce(buf)
            return buf

        def bare_all_reduce():
            dist.all_reduce(partial)

        fns = {
            "eager": lambda: models["eager"](x),
            "blocking": lambda: models["blocking"](x),
            "overlap": lambda: models["overlap"](x),
            "compute": lambda: models["compute"](x),
            "collective": schedule_collective,
            "bare_all_reduce": bare_all_reduce,
        }
        times, rounds = {}, {}
        # interleave the variants over several rounds, keep the best median of each: drifts in clock or
        # in the other rank's progress then touch every variant alike
        for _ in range(args.rounds):
            for name, fn in fns.items():
                t = median_ms(fn, args.reps, args.warmup, cuda)
                times[name] = min(times.get(name, float("inf")), t)
                rounds.setdefault(name, []).append(t)
    return {"side_layers": side_layers, "times": times, "rounds": rounds, "check": check,
            "between": [r.between for r in report.records]}


def write_json(results, numerics_ok: bool, gpus: int, args):
    """Rank 0's rows in the format of ``bench/harness.py``: ``ms`` the typical case (median over the rounds of
    each round's median), ``ms_best`` the best round, every round in ``ms_runs``; against ``(a) blocking``."""
    names = {"eager": "eager (hook)", "blocking": "(a) blocking", "overlap": "schedlang overlap_communication",
             "compute": "compute only", "collective": "all-reduce only (clone + AR)",
             "bare_all_reduce": "all-reduce only (bare)"}
    rows = []
    for r in results:
        work = f"overlap {args.tokens}x{args.hidden}, {r['side_layers']} side linears"
        for key, label in names.items():
            runs = r["rounds"][key]
            rows.append(harness.micro_row(work, label, "schedlang" if key == "overlap" else "baseline",
                                          statistics.median(runs), "ok" if numerics_ok else "FAIL numerics",
                                          baseline="(a) blocking", ms_best=round(min(runs), 4),
                                          ms_runs=[round(x, 4) for x in runs]))
    return harness.write_results("overlap-small" if args.small else "overlap", rows, gpus=gpus,
                                 directory=Path(args.results_dir) if args.results_dir else None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="gloo ranks on CPU (fp32)")
    parser.add_argument("--small", action="store_true", help="small sizes (checks the script)")
    parser.add_argument("--tokens", type=int, default=8192, help="batch x sequence")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inner", type=int, default=16384, help="MLP width before sharding")
    parser.add_argument("--side-layers", default="1,2,4", help="comma list: linears in the independent branch")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results-dir", default=None, help="where the JSON goes (default: bench/results)")
    args = parser.parse_args()
    if args.small:
        args.tokens, args.hidden, args.inner = 96, 48, 160
        args.reps, args.warmup, args.rounds = min(args.reps, 10), 2, 1

    cuda = torch.cuda.is_available() and not args.cpu
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
        dtype = torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300),
                            **({"device_id": device} if cuda else {}))
    if world < 2 and rank == 0:
        print("warning: one rank, the collectives are identities", flush=True)

    if rank == 0:
        print(f"date {datetime.datetime.now().isoformat(timespec='seconds')}  world {world}  {versions(cuda)}")
        print(f"tokens {args.tokens}  hidden {args.hidden}  inner {args.inner} ({args.inner // world} per rank)  "
              f"dtype {str(dtype).replace('torch.', '')}  reps {args.reps} x rounds {args.rounds}", flush=True)

    results = []
    for i, side in enumerate(int(s) for s in args.side_layers.split(",") if s.strip()):
        results.append(run_case(side, args, device, dtype, cuda, rank, world, show_code=i == 0))
        if cuda:
            torch.cuda.empty_cache()

    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        print("\n| side linears | eager ms | (a) blocking ms | (b) overlap ms | compute only ms | all-reduce only ms "
              "(clone+AR / bare AR) | (a)/(b) | hidden = ((a)-(b))/AR | ideal (a)/max(compute, AR) | "
              "rank 1 (a)/(b) | (a)==(b) | rel err vs unsharded |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
        for j, r in enumerate(results):
            t = r["times"]
            hidden = (t["blocking"] - t["overlap"]) / t["collective"]
            ideal = t["blocking"] / max(t["compute"], t["collective"])
            others = " / ".join(f"{g[j]['times']['blocking'] / g[j]['times']['overlap']:.3f}" for g in gathered[1:])
            c = r["check"]
            same = "yes" if c["a_equals_b"] else f"no (max {c['max_diff_a_b']:.2e})"
            print(f"| {r['side_layers']} | {t['eager']:.3f} | {t['blocking']:.3f} | {t['overlap']:.3f} | "
                  f"{t['compute']:.3f} | {t['collective']:.3f} / {t['bare_all_reduce']:.3f} | "
                  f"{t['blocking'] / t['overlap']:.3f} | {hidden * 100:.0f}% | {ideal:.3f} | {others or '-'} | "
                  f"{same} | {c['rel_err_vs_unsharded']:.1e} |")
        for r in results:
            c = r["check"]
            print(f"side {r['side_layers']}: nodes between start and wait {r['between']}, eager==(a) "
                  f"{c['eager_equals_a']}; median of each round (ms): " +
                  ", ".join(f"{k} " + "/".join(f"{v:.3f}" for v in vs) for k, vs in r["rounds"].items()))
        ok = all(all(r["check"]["a_equals_b"] for r in g) for g in gathered)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        ok_ref = all(all(r["check"]["rel_err_vs_unsharded"] < tol for r in g) for g in gathered)
        print(f"\nNUMERICS (a)==(b) on every rank: {ok}; every output within {tol:g} (relative to max |out|) of "
              f"the unsharded model: {ok_ref}", flush=True)
        print(f"wrote {write_json(results, ok and ok_ref, world if cuda else 0, args)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Building a tensor-parallel model from HF safetensors: time to the first step and peak host memory per rank.

    python bench/bench_pretrained.py                 # LLaMA-1.1B shapes, TP=2 on 2 GPUs (NCCL)
    python bench/bench_pretrained.py --tiny          # a small LLaMA on 2 CPU ranks (gloo): checks the script

Synthetic weights with the shapes of the chosen model are written once to a local directory
(``--dir``; bf16, split into files of about 1 GB with ``model.safetensors.index.json``, as the hub
ships checkpoints) and read by every variant. Each variant runs in **fresh rank processes**
(``schedlang.distributed.launch.run_distributed``), so each rank's peak resident set
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``: anonymous memory plus the file pages it mapped)
belongs to that variant alone. Before the variants run, the files are read once, so every variant finds
them in the page cache alike, and every variant runs once untimed (``--warmup-rounds``): on a fresh machine
the first process to run a variant's kernels also fills the disk caches of the libraries, the driver and
the compilers; that run's time to the first step is kept as ``first_run_time_to_first_step_s``. Then every
variant runs ``--rounds`` times (2 by default), the order reversed every other round, and a row's figures
are the medians over its rounds (each round's own in ``*_rounds``).

Variants (fp32 master weights, bf16 autocast on GPUs, AdamW; the first step is forward, backward
and optimizer step on the same batch on every rank):

* ``from_pretrained+parallelize_module`` (baseline): ``LlamaForCausalLM.from_pretrained(DIR)`` on
  every rank (the whole model in host memory), moved to the device, then PyTorch's
  ``parallelize_module`` with torchtitan's plan (vocabulary-parallel embedding, colwise q/k/v/gate/up,
  rowwise o/down, colwise LM head), loss under ``loss_parallel``.
* ``from_pretrained+schedlang-shard`` (baseline): the same loaded model given to
  ``schedlang.create_schedule`` + ``shard_model`` + ``build``.
* ``schedlang-build-pretrained`` (schedlang): the model made under ``init_empty_weights()``,
  ``shard_model``, then ``schedlang.build(sch, pretrained=DIR, device=...)``: each rank allocates
  its shards empty and reads only its slices from the files.

Reported per variant (rows in ``bench/results/<date>-pretrained[-tiny].json``, the shape
``bench/harness.py`` describes): ``time_to_first_step_s`` (from before loading to the end of the
first optimizer step, the slowest rank; the median over rounds), ``load_s`` (to the model and optimizer being ready),
``peak_host_rss_gib`` (the largest rank's peak) with ``peak_host_rss_gib_per_rank`` and
``host_rss_before_load_gib`` (the process before loading: Python, torch, CUDA context), the
steady step time (``ms``, median of a few steps after the first) and ``first_loss``. Check: the
first-step losses of all variants agree (1e-2 relative in bf16, 1e-4 in fp32: the same weights).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import baselines  # noqa: E402  (torchtitan's tensor-parallel plan, written once for every benchmark)
import harness  # noqa: E402

WORK = "llama-1.1b-from-safetensors"
VARIANTS = ("from_pretrained+parallelize_module", "from_pretrained+schedlang-shard", "schedlang-build-pretrained")
ROLES = {"from_pretrained+parallelize_module": "baseline", "from_pretrained+schedlang-shard": "baseline",
         "schedlang-build-pretrained": "schedlang"}
LR = 1e-5


def llama_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:  # big enough that a whole model per rank shows in the resident set (~45M parameters)
        cfg = LlamaConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                          intermediate_size=1376, vocab_size=32000, max_position_embeddings=256)
    else:  # LLaMA-1.1B (TinyLlama's depth and width, full multi-head attention)
        cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=22, num_attention_heads=16, num_key_value_heads=16,
                          intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5)
    cfg._attn_implementation = "sdpa"
    return cfg


# ------------------------------------------------------------------------------------------- the files
def write_checkpoint(directory: Path, cfg, shard_bytes: int) -> None:
    """Synthetic bf16 weights with the model's names and shapes, as a sharded HF checkpoint (seed 0)."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    groups: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in shapes.items():
        if "norm" in name:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = 0.02 * torch.randn(shape, generator=g)
        t = t.to(torch.bfloat16)
        if size and size + t.numel() * 2 > shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += t.numel() * 2
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in group})
        groups[i] = {}  # free as it goes
    total = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    cfg.dtype = torch.bfloat16
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(directory)


def ensure_checkpoint(directory: Path, cfg, shard_bytes: int) -> Path:
    stamp = directory / "bench-config.json"
    want = json.dumps({k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                     "num_key_value_heads", "intermediate_size", "vocab_size")})
    if not (stamp.is_file() and stamp.read_text() == want):
        if directory.exists():
            shutil.rmtree(directory)
        t = time.perf_counter()
        write_checkpoint(directory, cfg, shard_bytes)
        stamp.write_text(want)
        print(f"wrote synthetic weights to {directory} in {time.perf_counter() - t:.1f} s", flush=True)
    for f in sorted(directory.glob("*.safetensors")):  # into the page cache, for every variant alike
        with open(f, "rb") as handle:
            while handle.read(1 << 26):
                pass
    return directory


# ------------------------------------------------------------------------------------------- one rank
def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _build(variant: str, directory: str, cfg, device: torch.device, world: int):
    """The model, optimizer and a ``loss(ids, labels)`` of ``variant``, built from ``directory``."""
    import contextlib

    import schedlang
    from schedlang.distributed.cross_entropy import vocab_parallel_cross_entropy
    from schedlang.distributed.mesh import make_mesh
    from schedlang.models import shard_model
    from transformers import LlamaForCausalLM

    cuda = device.type == "cuda"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    opt_kw = {"lr": LR, "fused": True} if cuda else {"lr": LR, "foreach": True}
    if variant == "from_pretrained+parallelize_module":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

        model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device)
        model.config.use_cache = False
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh["tp"], baselines.titan_tp_plan(cfg))
        from torch.distributed.tensor import DTensor

        # one group of DTensor parameters and one of plain ones: torch's multi-tensor AdamW takes them apart
        groups = [[p for p in model.parameters() if isinstance(p, DTensor) == kind] for kind in (True, False)]
        opt = torch.optim.AdamW([{"params": g} for g in groups if g], **opt_kw)

        def loss(ids, labels):
            with amp():
                logits = model(input_ids=ids, use_cache=False).logits
            with loss_parallel():
                value = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
                value.backward()
            return value.detach()

        return model, opt, loss
    if variant == "from_pretrained+schedlang-shard":
        model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
        model.config._attn_implementation = "sdpa"
        sch = schedlang.create_schedule(model, mesh=make_mesh(tp=world, device_type=device.type))
        shard_model(sch)
        model, opt = schedlang.build(sch, device=device, optimizer=torch.optim.AdamW, **opt_kw)
    elif variant == "schedlang-build-pretrained":
        with schedlang.init_empty_weights():
            model = LlamaForCausalLM(cfg)
        sch = schedlang.create_schedule(model, mesh=make_mesh(tp=world, device_type=device.type))
        shard_model(sch)
        model, opt = schedlang.build(sch, pretrained=directory, device=device, optimizer=torch.optim.AdamW,
                                     **opt_kw)
    else:
        raise ValueError(f"unknown variant {variant!r}: valid are {', '.join(VARIANTS)}")
    del sch
    group = None
    from torch.distributed.tensor import DTensor

    group = next(p.device_mesh.get_group() for p in model.parameters() if isinstance(p, DTensor))

    def loss(ids, labels):
        with amp():
            logits = model(input_ids=ids, use_cache=False).logits
        value = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), group=group)
        value.backward()
        return value.detach()

    return model, opt, loss


def _profiled(profile_dir: Optional[str], name: str, fn, *args):
    """``fn(*args)``, under cProfile when ``profile_dir`` is given: the 50 costliest calls by cumulative time and
    the 30 by own time go to ``<profile_dir>/<name>.txt``, with any character of ``name`` other than letters,
    digits, ``-``, ``_`` and ``.`` made ``_`` (the timings of a profiled run include the profiler's overhead)."""
    if not profile_dir:
        return fn(*args)
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    result = profiler.runcall(fn, *args)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(50)
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    Path(profile_dir).mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)  # '+' in a variant's name
    (Path(profile_dir) / f"{safe}.txt").write_text(text.getvalue())
    return result


def run_rank(rank: int, world: int, variant: str, directory: str, tiny: bool, batch: int, seq: int,
             steps: int, profile_dir: Optional[str] = None) -> Dict[str, Any]:
    """One rank of one variant, in a fresh process: build, first step, a few timed steps. With ``profile_dir``,
    rank 0 profiles the build and the first step (see :func:`_profiled`)."""
    import torch.distributed as dist

    import schedlang  # noqa: F401  (imported before the clock starts, like transformers)
    import transformers  # noqa: F401

    cuda = torch.cuda.is_available() and not tiny
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = llama_config(tiny)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    ids, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    before = _peak_rss_gib()
    t0 = time.perf_counter()
    profile_dir = profile_dir if rank == 0 else None
    model, opt, loss = _profiled(profile_dir, f"{variant}-load", _build, variant, directory, cfg, device, world)
    if cuda:
        torch.cuda.synchronize(device)
    t_loaded = time.perf_counter()
    rss_loaded = _peak_rss_gib()

    def first_step():
        value = loss(ids, labels)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(value)  # waits for the step

    first_loss = _profiled(profile_dir, f"{variant}-first-step", first_step)
    t_first = time.perf_counter()
    rss = _peak_rss_gib()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        loss(ids, labels)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t) * 1e3)
    return {"load_s": t_loaded - t0, "time_to_first_step_s": t_first - t0, "peak_rss_gib": rss,
            "peak_rss_load_gib": rss_loaded,
            "rss_before_gib": before, "first_loss": first_loss, "step_ms": sorted(times)[len(times) // 2]
            if times else None, "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}


def compile_sources() -> None:
    """Byte-compile schedlang and the benchmarks, as pip does for an installed package: on a machine that runs with
    ``PYTHONDONTWRITEBYTECODE`` (the GPU hosts these figures come from) every variant's processes would otherwise
    compile the modules they import on the clock, and schedlang's variant imports more of them."""
    import compileall

    root = Path(__file__).resolve().parent.parent
    for directory in (root / "schedlang", root / "bench"):
        compileall.compile_dir(str(directory), quiet=1)


def _median(values: List[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# ------------------------------------------------------------------------------------------- the launcher
def main(argv=None) -> List[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small LLaMA on CPU ranks (gloo): checks the script")
    parser.add_argument("--nproc", type=int, default=2, help="tensor-parallel ranks (GPUs)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--dir", default=None,
                        help="where the synthetic checkpoint is written and read (default: a folder under the "
                             "system's temporary directory; kept for the next run)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5, help="steps timed after the first")
    parser.add_argument("--rounds", type=int, default=2,
                        help="times every variant runs (fresh processes each time, the order reversed every other "
                             "round); a row's figures are the medians over rounds")
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="untimed rounds before them (the first run on a fresh machine fills the disk caches)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds one variant may take")
    parser.add_argument("--name", default=None, help="result file name (default: pretrained[-tiny])")
    parser.add_argument("--results-dir", default=None, help="where the JSON goes (default: bench/results)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="profile rank 0's build and first step with cProfile (text reports in DIR); the row's "
                             "times then include the profiler's overhead")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.seq, args.steps = min(args.batch, 2), min(args.seq, 32), min(args.steps, 2)
    if args.rounds < 1 or args.warmup_rounds < 0:
        parser.error(f"--rounds must be at least 1 and --warmup-rounds at least 0, got {args.rounds} and "
                     f"{args.warmup_rounds}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}: valid are {', '.join(VARIANTS)}")
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        if torch.cuda.device_count() < args.nproc:
            parser.error(f"--nproc {args.nproc} needs {args.nproc} GPUs, found {torch.cuda.device_count()}")
    cfg = llama_config(args.tiny)
    directory = Path(args.dir) if args.dir else Path(os.environ.get("TMPDIR", "/tmp")) / (
        "schedlang-bench-pretrained-tiny" if args.tiny else "schedlang-bench-pretrained")
    ensure_checkpoint(directory, cfg, shard_bytes=(20 if args.tiny else 1000) * 2**20)
    n_params = sum(torch.Size(v).numel() for v in _shapes(cfg).values())
    file_gib = sum(f.stat().st_size for f in directory.glob("*.safetensors")) / 2**30

    from schedlang.distributed.launch import run_distributed

    backend = "nccl" if cuda else "gloo"
    compile_sources()
    per_variant: Dict[str, List[List[Dict[str, Any]]]] = {v: [] for v in variants}
    first_runs: Dict[str, float] = {}
    failures: Dict[str, BaseException] = {}
    # A first, untimed round: on a fresh machine the first process to run a variant's kernels pays for reading
    # their libraries from disk and for the driver's and compilers' caches (seconds, measured on H200 hosts);
    # its time to the first step is kept in the row as ``first_run_time_to_first_step_s``. Then the timed
    # rounds, every other one in reverse, so no variant always runs first or last.
    orders = [variants] * args.warmup_rounds + [variants if i % 2 == 0 else variants[::-1] for i in range(args.rounds)]
    for round_index, order in enumerate(orders):
        warm_up = round_index < args.warmup_rounds
        for variant in order:
            if variant in failures:
                continue
            label = "warm-up" if warm_up else f"round {round_index - args.warmup_rounds + 1}/{args.rounds}"
            print(f"{label}: {variant} ...", flush=True)
            try:
                per_rank = run_distributed(
                    run_rank, world_size=args.nproc,
                    args=(variant, str(directory), args.tiny, args.batch, args.seq, args.steps,
                          args.profile if round_index == args.warmup_rounds else None),
                    backend=backend, timeout=args.timeout)
            except Exception as e:  # one variant failing does not lose the others
                failures[variant] = e
                continue
            if warm_up:
                first_runs.setdefault(variant, max(r["time_to_first_step_s"] for r in per_rank))
            else:
                per_variant[variant].append(per_rank)

    rows, anchor = [], None
    tokens_per_step = args.batch * args.seq
    flops = harness.transformer_train_flops(n_params, cfg.num_hidden_layers, cfg.hidden_size, args.seq,
                                            tokens_per_step)
    for variant in variants:
        if variant in failures:
            rows.append(harness.failed_row(WORK, variant, ROLES[variant], failures[variant], layout=f"tp={args.nproc}"))
            continue
        rounds = per_variant[variant]
        first_loss = rounds[0][0]["first_loss"]
        tol = 1e-2 if cuda else 1e-4
        if anchor is None:
            anchor, check = first_loss, "ok (anchor)"
        else:
            rel = abs(first_loss - anchor) / max(abs(anchor), 1e-12)
            check = "ok" if rel <= tol else f"FAIL first loss {first_loss:.5f} vs {anchor:.5f} (rel {rel:.2e})"
        # each round's figure is its slowest rank's; the row's is the median over rounds
        first_step = [max(r["time_to_first_step_s"] for r in per_rank) for per_rank in rounds]
        load = [max(r["load_s"] for r in per_rank) for per_rank in rounds]
        steps = [max(r["step_ms"] for r in per_rank) for per_rank in rounds if per_rank[0]["step_ms"] is not None]
        gpu = [r["peak_gpu_gib"] for per_rank in rounds for r in per_rank if r["peak_gpu_gib"] is not None]
        last = rounds[-1]
        rows.append(harness.make_row(
            WORK, variant, ROLES[variant], _median(steps) if steps else None, tokens_per_step, flops,
            args.nproc if cuda else 0, round(max(gpu), 2) if gpu else None, check, layout=f"tp={args.nproc}",
            time_to_first_step_s=round(_median(first_step), 3),
            time_to_first_step_s_rounds=[round(x, 3) for x in first_step],
            load_s=round(_median(load), 3), load_s_rounds=[round(x, 3) for x in load],
            peak_host_rss_load_gib=round(max(r["peak_rss_load_gib"] for p in rounds for r in p), 3),
            peak_host_rss_load_gib_per_rank=[round(r["peak_rss_load_gib"], 3) for r in last],
            peak_host_rss_gib=round(max(r["peak_rss_gib"] for p in rounds for r in p), 3),
            host_rss_before_load_gib=round(max(r["rss_before_gib"] for p in rounds for r in p), 3),
            first_loss=round(first_loss, 6), params=n_params, checkpoint_gib=round(file_gib, 3),
            rounds=len(rounds), first_run_time_to_first_step_s=(round(first_runs[variant], 3)
                                                                 if variant in first_runs else None)))
    path = harness.write_results(args.name or ("pretrained-tiny" if args.tiny else "pretrained"), rows,
                                 gpus=args.nproc if cuda else 0,
                                 directory=Path(args.results_dir) if args.results_dir else None, ranks=args.nproc,
                                 command=" ".join(["bench/bench_pretrained.py"] + (argv if argv is not None
                                                                                   else sys.argv[1:])))
    print(harness.text_table(rows))
    print(f"\n{'variant':36s} {'first step s':>12s} {'load s':>8s} {'host RSS GiB: before':>21s} "
          f"{'loaded (per rank)':>24s} {'after step 1':>12s}")
    for r in rows:
        if r.get("time_to_first_step_s") is not None:
            print(f"{r['variant']:36s} {r['time_to_first_step_s']:12.2f} {r['load_s']:8.2f} "
                  f"{r['host_rss_before_load_gib']:21.2f} {str(r['peak_host_rss_load_gib_per_rank']):>24s} "
                  f"{r['peak_host_rss_gib']:12.2f}")
    print(f"\nwrote {path}")
    return rows


def _shapes(cfg) -> Dict[str, tuple]:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}


if __name__ == "__main__":
    main()

"""The ``schedlang`` command.

``schedlang demo`` schedules the built-in :class:`~schedlang.models.tiny_transformer.TinyTransformer`:
it prints the module tree, the schedule's plan, the verification result and a table
comparing the eager model with the scheduled one. ``--world-size N`` spawns N local
ranks (gloo on CPU, NCCL on GPUs) and shows tensor parallelism.

``schedlang train ...`` is the trainer (:mod:`schedlang.train`; ``schedlang train --help``).
``schedlang bench [NAME ...]`` runs the GPU benchmarks in ``bench/`` (from a source
checkout) and ``schedlang primitives`` lists the schedule primitives.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch


def _saved_activation_bytes(step) -> int:
    """Bytes of tensors autograd keeps for backward during one forward (what checkpointing reduces)."""
    total = {"bytes": 0}

    def pack(t):
        total["bytes"] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step(backward=False)
    loss.backward()
    return total["bytes"]


def _timed(steps, device: torch.device, repeats: int) -> List[float]:
    """Median milliseconds of each step; the steps alternate so that background load hits all alike."""
    for step in steps:
        step()
        step()
    times: List[List[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for i, step in enumerate(steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[i].append(time.perf_counter() - start)
    return [sorted(t)[len(t) // 2] * 1e3 for t in times]


def _make_step(model, ids, targets):
    def step(backward: bool = True):
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        if backward:
            loss.backward()
            for p in model.parameters():
                p.grad = None
        return loss

    return step


def _demo_rank(rank: int, world: int, args: Dict) -> Optional[str]:
    import schedlang
    from schedlang.models.tiny_transformer import TinyConfig, TinyTransformer, tensor_parallel_schedule

    device = torch.device(args["device"], rank if args["device"] == "cuda" else None) \
        if args["device"] == "cuda" else torch.device("cpu")
    lines: List[str] = []
    out = lines.append
    torch.manual_seed(0)
    cfg = TinyConfig(num_layers=args["layers"], hidden_size=args["hidden"], num_heads=4,
                     intermediate_size=4 * args["hidden"])
    model = TinyTransformer(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (args["batch"], args["seq"]), device=device,
                        generator=torch.Generator(device=device).manual_seed(1))
    targets = torch.roll(ids, -1, dims=1)
    world_note = f"{world} ranks ({'nccl' if device.type == 'cuda' else 'gloo'})" if world > 1 else "1 process"
    out(f"schedlang {schedlang.__version__} demo: torch {torch.__version__}, device {device.type}, {world_note}")
    out("\n== The model (unchanged user code) ==")
    out(str(model))

    sch = schedlang.create_schedule(model)
    out("\n== Schedule ==")
    with schedlang.Verify(sch, example_inputs=[ids]) as check:
        if world > 1:
            tensor_parallel_schedule(sch)
        for i in range(cfg.num_layers):
            sch[f"blocks.{i}"].checkpoint()
    out(str(sch.plan))
    out("\n== Verification (forward and backward against the original model) ==")
    out(str(check.report))
    scheduled, _ = schedlang.build(sch)
    if world > 1:
        out(f"\nrank {rank}: blocks.0.mlp.fc1 is now {scheduled.blocks[0].mlp.fc1} "
            f"(attention heads per rank: {cfg.num_heads // world})")

    model.train()
    scheduled.train()
    eager_step = _make_step(model, ids, targets)
    sched_step = _make_step(scheduled, ids, targets)
    rows = []
    timings = _timed([eager_step, sched_step], device, args["repeats"])
    for name, m, step, ms in (("eager", model, eager_step, timings[0]), ("scheduled", scheduled, sched_step, timings[1])):
        saved = _saved_activation_bytes(step)
        params = sum(p.numel() * p.element_size() for p in m.parameters())
        rows.append((name, ms, saved, params))
    out(f"\n== Eager vs scheduled: training step (batch {args['batch']}, seq {args['seq']}) "
        f"{'on rank ' + str(rank) + ' ' if world > 1 else ''}==")
    out(f"{'':<11}{'step ms':>10}{'vs eager':>10}{'saved activations':>20}{'parameters':>14}")
    base_ms, base_saved, base_params = rows[0][1], rows[0][2], rows[0][3]
    for name, ms, saved, params in rows:
        out(f"{name:<11}{ms:>10.2f}{base_ms / ms:>9.2f}x{saved / 2**20:>17.2f} MB{params / 2**20:>11.2f} MB")
    out(f"\nThe scheduled model keeps {rows[1][2] / base_saved:.0%} of the activations for backward "
        f"(checkpointed blocks)" + (f" and {rows[1][3] / base_params:.0%} of the parameters per rank "
                                    f"(tensor parallel over {world} ranks)" if world > 1 else "") + ".")
    return "\n".join(lines) if rank == 0 else None


def cmd_demo(ns: argparse.Namespace) -> int:
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("schedlang demo: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    if ns.world_size < 1:
        print("schedlang demo: --world-size must be at least 1", file=sys.stderr)
        return 2
    if ns.hidden % 4:
        print(f"schedlang demo: --hidden must be divisible by the 4 attention heads, got {ns.hidden}", file=sys.stderr)
        return 2
    if 4 % ns.world_size:
        print(f"schedlang demo: the demo model has 4 attention heads; --world-size must divide 4 "
              f"(1, 2 or 4), got {ns.world_size}", file=sys.stderr)
        return 2
    args = dict(device=device, layers=ns.layers, hidden=ns.hidden, batch=ns.batch, seq=ns.seq, repeats=ns.repeats)
    if ns.world_size == 1:
        print(_demo_rank(0, 1, args))
        return 0
    if device == "cuda" and torch.cuda.device_count() < ns.world_size:
        print(f"schedlang demo: --world-size {ns.world_size} needs {ns.world_size} GPUs, found "
              f"{torch.cuda.device_count()}", file=sys.stderr)
        return 2
    from .distributed.launch import run_distributed

    results = run_distributed(_demo_rank, world_size=ns.world_size, args=(args,),
                              backend="nccl" if device == "cuda" else "gloo", timeout=600)
    print(results[0])
    return 0


def _bench_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "bench"


def cmd_bench(ns: argparse.Namespace) -> int:
    bench = _bench_dir()
    scripts = sorted(bench.glob("bench_*.py")) if bench.is_dir() else []
    if not scripts:
        print("schedlang bench: no benchmarks found (they live in bench/ of a source checkout)", file=sys.stderr)
        return 2
    available = {s.stem[len("bench_"):]: s for s in scripts}
    names = ns.names or list(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        print(f"schedlang bench: unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(available)}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("schedlang bench: the benchmarks compare GPU kernels and need a CUDA device", file=sys.stderr)
        return 2
    status = 0
    for n in names:
        print(f"== bench {n} ==", flush=True)
        status |= subprocess.call([sys.executable, str(available[n])], cwd=str(bench.parent))
    return status


def cmd_primitives(ns: argparse.Namespace) -> int:
    import schedlang

    for name in schedlang.list_primitives():
        print(name)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # the trainer parses its own flags (`schedlang train --help`)
        from .train import main as train_main

        return train_main(argv[1:], prog="schedlang train")
    parser = argparse.ArgumentParser(prog="schedlang", description="A schedule language for optimizing PyTorch models")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train a LLaMA / GPT-2 model on a pp x dp x tp layout (see schedlang train --help)",
                   add_help=False)
    demo = sub.add_parser("demo", help="schedule, verify and time the built-in small transformer")
    demo.add_argument("--world-size", type=int, default=1, help="local ranks for tensor parallelism (default 1)")
    demo.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when present, else cpu")
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--hidden", type=int, default=128)
    demo.add_argument("--batch", type=int, default=8)
    demo.add_argument("--seq", type=int, default=128)
    demo.add_argument("--repeats", type=int, default=5, help="timed steps (median reported)")
    demo.set_defaults(fn=cmd_demo)
    bench = sub.add_parser("bench", help="run the GPU benchmarks against their baselines")
    bench.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    bench.set_defaults(fn=cmd_bench)
    prims = sub.add_parser("primitives", help="list the schedule primitives")
    prims.set_defaults(fn=cmd_primitives)
    ns = parser.parse_args(argv)
    return ns.fn(ns)


if __name__ == "__main__":
    sys.exit(main())

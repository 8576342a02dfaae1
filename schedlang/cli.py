"""The ``schedlang`` command.

``schedlang demo`` schedules a tiny HuggingFace LLaMA (:mod:`schedlang.demo`): the printed plan,
Verify's result and a table of the original model against its schedule, in one process and
tensor parallel over ``--world-size`` local ranks (gloo on CPU, NCCL on GPUs).
``schedlang report --out report.html`` writes the demo's schedule (or ``--plan plan.json``
replayed on ``--model``) as a self-contained HTML page (:mod:`schedlang.report`).

``schedlang train ...`` is the trainer (:mod:`schedlang.train`; ``schedlang train --help``).
``schedlang bench [NAME ...]`` runs the GPU benchmarks in ``bench/`` (from a source
checkout) and ``schedlang primitives`` lists the schedule primitives.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

from .utils.paths import nearest_existing, refuses_new_files


def _demo_options(ns: argparse.Namespace) -> Optional[str]:
    """The first problem with the demo's flags, or None."""
    if ns.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda but no CUDA device is available"
    if ns.world_size < 1:
        return f"--world-size must be at least 1, got {ns.world_size}"
    # sizes first: the checks below divide by them, and the model would fail deep inside torch on a size < 1
    for flag in ("layers", "hidden", "heads", "batch", "seq", "repeats"):
        if getattr(ns, flag) < 1:
            return f"--{flag} must be at least 1, got {getattr(ns, flag)}"
    if ns.intermediate is not None and ns.intermediate < 1:
        return f"--intermediate must be at least 1 (or left out for 2 x --hidden + 176), got {ns.intermediate}"
    if ns.hidden % ns.heads:
        return f"--hidden must be divisible by the {ns.heads} attention heads, got {ns.hidden}"
    if ns.heads % 4:
        return f"--heads must be a multiple of the demo model's 4 key/value heads, got {ns.heads}"
    if 4 % ns.world_size:
        return (f"the demo model has 4 key/value heads to split over the ranks; --world-size must divide 4 "
                f"(1, 2 or 4), got {ns.world_size}")
    if ns.device == "cuda" and torch.cuda.device_count() < ns.world_size:
        return (f"--world-size {ns.world_size} needs {ns.world_size} GPUs, found {torch.cuda.device_count()} "
                "(--world-size 1 runs on one)")
    return None


def _output_problem(flag: str, path: str) -> Optional[str]:
    """Why the HTML page ``path`` could not be written, or None; checked before the minutes of work that
    precede the writing. Missing folders are created by the writer, so the nearest existing one is probed (by
    making a file there)."""
    target = Path(path)
    if target.is_dir():
        return f"{flag} {path!r} is a directory: give the path of the HTML file to write, e.g. {flag} report.html"
    existing = nearest_existing(target.parent)
    if not existing.is_dir():
        return f"{flag} {path!r}: {str(existing)!r} is a file, so no folder can be made there; give another path"
    reason = refuses_new_files(existing)
    if reason:
        return f"{flag} {path!r}: {str(existing)!r} refuses new files ({reason}); give a writable path"
    return None


def _demo_kwargs(ns: argparse.Namespace) -> Dict:
    return dict(layers=ns.layers, hidden=ns.hidden, heads=ns.heads, intermediate=ns.intermediate or 2 * ns.hidden + 176,
                batch=ns.batch, seq=ns.seq, repeats=ns.repeats, compile=not ns.no_compile)


def _progress(line: str) -> None:
    """What the demo does next, on stderr: the results come on stdout once all of it has run."""
    print(f"schedlang demo: {line} ...", file=sys.stderr, flush=True)


def cmd_demo(ns: argparse.Namespace) -> int:
    ns.device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    problem = _demo_options(ns) or (_output_problem("--report", ns.report) if ns.report else None)
    if problem:
        print(f"schedlang demo: {problem}", file=sys.stderr)
        return 2
    from .demo import run_demo
    from .errors import SchedlangError
    from .quiet_imports import quiet_torchao_import

    quiet_torchao_import()
    try:
        print(run_demo(world_size=ns.world_size, device=ns.device, report=ns.report, progress=_progress,
                       **_demo_kwargs(ns)))
    except SchedlangError as e:
        print(f"schedlang demo: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_report(ns: argparse.Namespace) -> int:
    """Write the HTML report of the demo's schedule, or of a saved plan replayed on a model."""
    import schedlang

    problem = _output_problem("--out", ns.out)
    if problem is None and ns.plan is None and ns.model is not None:
        problem = (f"--model {ns.model} names the model a saved plan is replayed on, so it needs --plan; without "
                   "--plan the page shows the demo's schedule, sized by the demo's flags")
    if problem:
        print(f"schedlang report: {problem}", file=sys.stderr)
        return 2
    if ns.plan is None:
        ns.device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
        problem = _demo_options(ns)
        if problem:
            print(f"schedlang report: {problem}", file=sys.stderr)
            return 2
        from .demo import DemoOptions, _scheduled_run, _tp_rank

        opts = DemoOptions(device=ns.device, report=ns.out, report_single=ns.out, **_demo_kwargs(ns))
        if ns.world_size == 1:
            _scheduled_run(0, 1, opts)
        else:
            from .distributed.launch import run_distributed

            run_distributed(_tp_rank, world_size=ns.world_size, args=(opts,),
                            backend="nccl" if ns.device == "cuda" else "gloo", timeout=600)
        print(f"wrote {ns.out}")
        return 0
    from .errors import SchedlangError

    try:
        with open(ns.plan) as f:
            text = f.read()
        model = _model_for_plan(ns.model)
        sch = schedlang.replay(text, model)
    except (OSError, SchedlangError) as e:
        print(f"schedlang report: {e}", file=sys.stderr)
        return 2
    sch.report(ns.out, title=f"Plan {ns.plan} on {type(model).__name__}")
    print(f"wrote {ns.out}")
    return 0


_REPORT_MODELS = ("llama-tiny", "gpt2-tiny", "demo")


def _model_for_plan(name: Optional[str]):
    """The model a saved plan is replayed on: a tiny ready-made one, or ``module:factory`` (a class or a
    function of no arguments)."""
    from .errors import ScheduleValueError

    if name in (None, "demo"):
        from .demo import DemoOptions, demo_model

        return demo_model(DemoOptions(), torch.device("cpu"))
    if name in ("llama-tiny", "gpt2-tiny"):  # the trainer's tiny sizes
        from .train import _model_class, model_config

        family = name.split("-")[0]
        torch.manual_seed(0)
        return _model_class(family)(model_config(family, "tiny"))
    if ":" in name:
        import importlib

        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ScheduleValueError(f"--model {name!r}: cannot import {attr!r} from {module_name!r} ({e})") from e
        return factory()
    raise ScheduleValueError(f"--model {name!r} is not known: valid are {', '.join(_REPORT_MODELS)} or "
                             "'package.module:factory'")


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
        command = [sys.executable, str(available[n])]
        ranks = _BENCH_RANKS.get(n, 1)
        if ranks > 1:
            if torch.cuda.device_count() < ranks:
                print(f"schedlang bench: {n} needs {ranks} GPUs; skipped", file=sys.stderr)
                continue
            command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", str(available[n])]
        status |= subprocess.call(command, cwd=str(bench.parent))
    if "train" in names:
        print("(bench train ran the 1-GPU works; the 2-GPU ones: torchrun --nproc_per_node=2 bench/bench_train.py "
              "--work llama-1.1b-tp2,llama-1.1b-2gpu)", flush=True)
    return status


#: benchmarks that run one process per GPU under torchrun, and how many
_BENCH_RANKS = {"overlap": 2}


def cmd_primitives(ns: argparse.Namespace) -> int:
    import schedlang

    for name in schedlang.list_primitives():
        print(name)
    return 0


def _add_demo_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2,
                        help="local ranks for tensor parallelism (default 2; 1 runs in this process only)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--hidden", type=int, default=256,
                        help="hidden size, divisible by --heads (default 256)")
    parser.add_argument("--heads", type=int, default=8,
                        help="attention heads, a multiple of the model's 4 key/value heads (default 8)")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default 2 x hidden + 176: 688 at hidden 256)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per training step (default 8)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # the trainer parses its own flags (`schedlang train --help`)
        from .train import main as train_main

        return train_main(argv[1:], prog="schedlang train")
    if argv[:1] == ["tune"]:  # the tuner parses its own flags (`schedlang tune --help`)
        from .autotune.tune import main as tune_main

        return tune_main(argv[1:])
    parser = argparse.ArgumentParser(prog="schedlang", description="A schedule language for optimizing PyTorch models")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train a LLaMA / GPT-2 model on a pp x dp x tp layout (see schedlang train --help)",
                   add_help=False)
    demo = sub.add_parser("demo", help="schedule, verify and time a tiny LLaMA against the original model",
                          description="Schedule a tiny HuggingFace LLaMA built from a config (tensor parallelism over "
                                      "--world-size local ranks, the SwiGLU of every MLP fused into one kernel, "
                                      "activation checkpointing when memory is short), verify it against the original "
                                      "and time a training step of each.")
    _add_demo_flags(demo)
    demo.add_argument("--repeats", type=int, default=5, help="timed steps, the median reported (default 5)")
    demo.add_argument("--no-compile", action="store_true", help="do not compile the decoder layers after build")
    demo.add_argument("--report", default=None, metavar="FILE", help="also write the schedule's HTML report here")
    demo.set_defaults(fn=cmd_demo)
    report = sub.add_parser("report", help="write an HTML page of what a schedule did (default: the demo's)",
                            description="Write one self-contained HTML page of what a schedule did: the demo's "
                                        "schedule (sized by the demo's flags below), or with --plan a saved plan "
                                        "replayed on --model.")
    report.add_argument("--out", default="report.html", help="the page to write (default report.html)")
    report.add_argument("--plan", default=None, help="a saved plan (JSON) to replay and report instead of the demo's")
    report.add_argument("--model", default=None,
                        help="with --plan: demo, llama-tiny, gpt2-tiny or package.module:factory (default demo)")
    _add_demo_flags(report)
    report.set_defaults(fn=cmd_report, repeats=1, no_compile=True)
    bench = sub.add_parser("bench", help="run the GPU benchmarks against their baselines")
    bench.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    bench.set_defaults(fn=cmd_bench)
    sub.add_parser("tune", help="search schedule knobs by measured training steps (see schedlang tune --help)",
                   add_help=False)
    prims = sub.add_parser("primitives", help="list the schedule primitives")
    prims.set_defaults(fn=cmd_primitives)
    ns = parser.parse_args(argv)
    return ns.fn(ns)


if __name__ == "__main__":
    sys.exit(main())

"""How close the trainer's memory estimate comes to the measured peak, layout by layout.

``schedlang train`` prints, before it allocates anything, the memory per rank that its cost model
(``schedlang.autotune.training_cost``) expects, and at the end the peak it measured
(``torch.cuda.max_memory_allocated`` on rank 0). This script runs the trainer under torchrun for a few
steps in each of several layouts of one model and writes both figures and their error per layout:

    python bench/train_memory.py                      # LLaMA-1.1B, global batch 8 x 2048, on 2 GPUs
    python bench/train_memory.py --tiny --nproc 2     # the tiny LLaMA on 2 CPU ranks: checks the script

Each layout is its own ``torchrun --nproc_per_node=N -m schedlang.train ... --steps S --metrics FILE``;
the figures are read from the last line of the metrics file (``mem_gib``: rank 0's peak over the run;
``mem_estimated_gib``: the estimate of the plan block). Rows go to
``bench/results/<date>-train-memory.json`` (work ``llama-1.1b-2gpu-memory``; ``llama-tiny-memory``
with ``--tiny``), one per layout, with ``error`` = measured / estimated - 1. On the CPU the measured
figure is the process's resident set (interpreter and libraries included), so only the GPU rows say
how good the estimate is.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import harness as H  # noqa: E402  (bench/harness.py)

#: the layouts of the 2-GPU work: the trainer's own choice first, then one of each kind the cost model covers
LAYOUTS = {
    "auto": [],
    "fsdp": ["--dp", "2"],
    "ddp": ["--dp", "2", "--dp-mode", "ddp"],
    "fsdp-checkpoint": ["--dp", "2", "--activation-checkpoint"],
    "fsdp-eager": ["--dp", "2", "--no-compile"],
    "tp": ["--tp", "2"],
    "pp": ["--pp", "2", "--microbatches", "4"],
}


def run_layout(name: str, extra, args, directory: Path) -> dict:
    metrics = directory / f"{name}.jsonl"
    model = (["--config", "tiny", "--global-batch", "4", "--seq", "32", "--device", "cpu"] if args.tiny else
             ["--config", "1b", "--global-batch", str(args.global_batch), "--seq", str(args.seq)])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "schedlang.train", *model, "--steps", str(args.steps), "--metrics", str(metrics), *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                            env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
    flags = " ".join(extra) or "(defaults)"
    if result.returncode != 0 or not metrics.exists():
        return {"layout_flags": flags, "check": f"FAIL exit {result.returncode}: {result.stderr.strip()[-600:]}"}
    last = json.loads(metrics.read_text().splitlines()[-1])
    measured, estimated = last["mem_gib"], last["mem_estimated_gib"]
    plan = [line.strip() for line in result.stderr.splitlines() + result.stdout.splitlines()
            if line.strip().startswith(("layout ", "per rank "))]
    return {"layout_flags": flags, "plan": plan, "measured_gib": round(measured, 6),
            "estimated_gib": round(estimated, 6), "error": round(measured / estimated - 1, 4), "check": "ok"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny LLaMA on CPU ranks (checks the script)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of: " + ", ".join(LAYOUTS))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per layout")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; known: {', '.join(LAYOUTS)}")
    work = "llama-tiny-memory" if args.tiny else "llama-1.1b-2gpu-memory"
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for name in names:
            row = run_layout(name, LAYOUTS[name], args, Path(directory))
            row.update(work=work, variant=name, role="schedlang")
            print(json.dumps(row), flush=True)
            rows.append(row)
    gpus = 0 if args.tiny else args.nproc
    path = H.write_results("train-memory" + ("-tiny" if args.tiny else ""), rows, gpus=gpus,
                           directory=args.results_dir, command=" ".join(["bench/train_memory.py", *(argv or sys.argv[1:])]))
    print(f"wrote {path}")
    return 0 if all(r["check"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

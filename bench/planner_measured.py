"""The planner's estimate beside the trainer's measured peak memory and step time, on the GPUs of this machine.

For each row (a layout of the trainer that fits the GPUs here), this script asks ``schedlang train --dry-run
--json`` for the estimate (peak memory of the largest rank, step time), then runs the same command line for
real and reads its metrics: the peak of ``torch.cuda.max_memory_allocated`` over the steps, and the median
step time of the steps after the warm-up (the first steps include compilation). The error of each is
``estimate / measured - 1``.

``python bench/planner_measured.py --out bench/results/`` writes ``<date>-planner-measured-<device>-<sha>.json``
with every row, the device, the git commit and the library versions. It needs CUDA; rows that need more GPUs
than the machine has are skipped and listed as such.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
STEPS, WARMUP = 10, 4

#: layouts of the trainer's LLaMA-1B preset (hidden 2048, 22 layers) at sequence 2048, bf16, AdamW
ROWS: List[Dict] = [
    {"name": "LLaMA-1B, 1 GPU, batch 8 x 2048, no checkpointing", "gpus": 1,
     "flags": ["--config", "1b", "--global-batch", "8"]},
    {"name": "LLaMA-1B, 1 GPU, batch 16 x 2048, full checkpointing", "gpus": 1,
     "flags": ["--config", "1b", "--global-batch", "16", "--activation-checkpoint", "full"]},
    {"name": "LLaMA-1B, 1 GPU, batch 16 x 2048, selective checkpointing", "gpus": 1,
     "flags": ["--config", "1b", "--global-batch", "16", "--activation-checkpoint", "selective"]},
    {"name": "LLaMA-1B, 1 GPU, batch 8 x 2048, eager (no compile, no fused kernels)", "gpus": 1,
     "flags": ["--config", "1b", "--global-batch", "8", "--no-compile", "--no-optimize"]},
    {"name": "LLaMA-1B, 2 GPUs, FSDP 2, batch 16 x 2048", "gpus": 2,
     "flags": ["--config", "1b", "--global-batch", "16", "--dp", "2"]},
    {"name": "LLaMA-1B, 2 GPUs, TP 2 + SP, batch 8 x 2048", "gpus": 2,
     "flags": ["--config", "1b", "--global-batch", "8", "--tp", "2", "--sp"]},
    {"name": "LLaMA-1B, 4 GPUs, FSDP 2 x TP 2, batch 16 x 2048", "gpus": 4,
     "flags": ["--config", "1b", "--global-batch", "16", "--dp", "2", "--tp", "2", "--sp"]},
]
COMMON = ["--model", "llama", "--seq", "2048", "--dtype", "bf16", "--device", "cuda", "--optimizer", "adamw",
          "--log-every", "1000", "--seed", "0"]


def _launch(gpus: int) -> List[str]:
    if gpus == 1:
        return [sys.executable, "-m", "schedlang.train"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
            "-m", "schedlang.train"]


def run_row(row: Dict, work: Path) -> Dict:
    flags = COMMON + row["flags"]
    plan = work / "plan.json"
    subprocess.run([sys.executable, "-m", "schedlang.train", "--dry-run", "--json", str(plan),
                    "--nodes", "1", "--gpus-per-node", str(row["gpus"]), *flags], check=True, cwd=ROOT)
    estimate = json.loads(plan.read_text())
    metrics = work / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    done = subprocess.run([*_launch(row["gpus"]), *flags, "--steps", str(STEPS), "--metrics", str(metrics)],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return {"name": row["name"], "flags": flags, "error": done.stderr[-3000:], "estimate": estimate}
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step_time_s"] * 1e3 for r in records[WARMUP:]]
    measured_gib = max(r["mem_gib"] for r in records)
    measured_ms = statistics.median(steps)
    return {"name": row["name"], "gpus": row["gpus"], "flags": flags,
            "estimated_peak_gib": estimate["peak_gib"], "measured_peak_gib": measured_gib,
            "peak_error": estimate["peak_gib"] / measured_gib - 1,
            "estimated_step_ms": estimate["step_ms"], "measured_step_ms": measured_ms,
            "measured_step_ms_min_max": [min(steps), max(steps)],
            "step_error": estimate["step_ms"] / measured_ms - 1,
            "layout": estimate.get("layout"), "tokens_per_s_measured": records[-1].get("tokens_per_s")}


def _versions() -> Dict[str, str]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": str(torch.version.cuda), "python": sys.version.split()[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--sha", default=None, help="the commit measured (default: git rev-parse HEAD)")
    p.add_argument("--only", default=None, help="comma-separated row numbers (from 0) to run; default: all")
    ns = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("planner_measured: needs CUDA", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    device = torch.cuda.get_device_name(0)
    sha = ns.sha or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                   text=True).stdout.strip() or "unknown"
    rows, skipped = [], []
    chosen = [ROWS[int(i)] for i in ns.only.split(",")] if ns.only else ROWS
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = "h200" if "H200" in device else "h100" if "H100" in device else "gpu"
    path = out / f"{datetime.date.today().isoformat()}-planner-measured-{slug}-{sha}.json"

    def write():  # after every row, so a run stopped at its time limit keeps the rows it measured
        path.write_text(json.dumps({"device": device, "gpus": gpus, "git_sha": sha, "versions": _versions(),
                                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                    "steps": STEPS, "warmup_steps": WARMUP, "rows": rows, "skipped": skipped},
                                   indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        for row in chosen:
            if row["gpus"] > gpus:
                skipped.append({"name": row["name"], "why": f"needs {row['gpus']} GPUs, this machine has {gpus}"})
                continue
            result = run_row(row, Path(tmp))
            rows.append(result)
            if "error" in result:
                print(f"{row['name']}: FAILED\n{result['error']}", flush=True)
            else:
                print(f"{row['name']}: peak {result['measured_peak_gib']:.2f} GiB measured, "
                      f"{result['estimated_peak_gib']:.2f} estimated ({100 * result['peak_error']:+.1f}%); step "
                      f"{result['measured_step_ms']:.1f} ms measured, {result['estimated_step_ms']:.1f} estimated "
                      f"({100 * result['step_error']:+.1f}%)", flush=True)
            write()
    write()
    print(f"wrote {path}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""One rank of each published run of the validation table, run for real on one GPU: its allocated and reserved peaks.

torchtitan's published figures are reserved memory of ranks of 128 to 512-GPU jobs; the planner estimates
tensors. ``schedlang train --dry-run --trace-memory gpu`` builds rank 0 of such a job on the one GPU here, in a
fake process group of the job's world size, with the row's flags (torch.compile and float8 included) and runs
three training steps: the caching allocator's peaks are then those of a rank of the job, communication apart.
Each row runs once per allocator setting, in a process of its own (the setting is read when CUDA starts):
torch's default and expandable segments (the trainer's own setting, and that of torchtitan's single-node launch
script; its multi-node Slurm script of the same commit names none, so those runs had torch's default).

``python bench/planner_on_gpu.py --out bench/results/`` writes
``<date>-planner-on-gpu-<device>-<sha>.json`` with the device, the commit and the versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from allocator_reserve import ALLOCATOR_SETTINGS  # noqa: E402
from planner_measured import _versions  # noqa: E402
from validate_planner import COMMON, ROWS  # noqa: E402  (the published rows)

#: ``schedlang train`` in a process of its own
_TRAIN = "import sys; from schedlang.train import main; sys.exit(main(sys.argv[1:]))"
#: the settings run: torch's default, and expandable segments
SETTINGS = ("default", "expandable_segments")


def run_row(row: Dict, setting: str, timeout: float) -> Dict:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"planner-on-gpu-{os.getpid()}.json"
    flags = [*COMMON, *row["flags"], "--trace-memory", "gpu", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_SETTINGS[setting]
    try:
        done = subprocess.run([sys.executable, "-c", _TRAIN, *flags], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as late:
        # what the run printed before its time ran out says where the time went
        said = late.stderr.decode(errors="replace") if isinstance(late.stderr, bytes) else (late.stderr or "")
        return {"name": row["name"], "allocator": setting, "flags": row["flags"],
                "error": f"over {timeout:.0f} s", "stderr_tail": said[-2000:]}
    if done.returncode != 0 or not out.exists():
        return {"name": row["name"], "allocator": setting, "flags": row["flags"], "error": done.stderr[-3000:]}
    plan = json.loads(out.read_text())
    out.unlink()
    allocated, reserved = plan["gpu_allocated_peak_gib"], plan["gpu_reserved_peak_gib"]
    return {"name": row["name"], "allocator": setting, "flags": row["flags"], "published_gib": row["published_gib"],
            "allocated_gib": round(allocated, 2), "reserved_gib": round(reserved, 2),
            "formula_gib": round(plan["gpu_formula_peak_gib"], 2),
            "reserved_error_pct": round(100 * (reserved / row["published_gib"] - 1), 1),
            "allocated_vs_formula_pct": round(100 * (allocated / plan["gpu_formula_peak_gib"] - 1), 1),
            "allocator_setting": plan["gpu_allocator"], "steps": plan["gpu_steps"], "device": plan["gpu_device"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--sha", default=None, help="the commit measured (default: git rev-parse --short HEAD)")
    p.add_argument("--only", default=None, help="comma-separated row numbers (from 0); default: every row")
    p.add_argument("--allocator", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds a row may take (default 420)")
    ns = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("planner_on_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    settings = ns.allocator.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        p.error(f"--allocator {','.join(unknown)}: valid settings are {', '.join(SETTINGS)}")
    device = torch.cuda.get_device_name(0)
    sha = ns.sha or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                   text=True).stdout.strip() or "unknown"
    chosen = [ROWS[int(i)] for i in ns.only.split(",")] if ns.only else ROWS
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = "h200" if "H200" in device else "h100" if "H100" in device else "gpu"
    path = out / f"{datetime.date.today().isoformat()}-planner-on-gpu-{slug}-{sha}.json"
    rows: List[Dict] = []
    for row in chosen:
        for setting in settings:
            result = run_row(row, setting, ns.timeout)
            rows.append(result)
            print(json.dumps(result)[:600], flush=True)
            # written after every row, so a run stopped at its time limit keeps what it measured
            path.write_text(json.dumps({
                "date": datetime.date.today().isoformat(), "device": device, "git_sha": sha,
                "versions": _versions(), "common_flags": COMMON,
                "what": "rank 0 of each published run, built by the trainer on one GPU in a fake process group of "
                        "the run's world size (schedlang train --dry-run --trace-memory gpu, one process per row "
                        "and allocator setting): torch.cuda.max_memory_allocated and max_memory_reserved over its "
                        "training steps, beside the formula's estimate",
                "allocator_settings": {s: ALLOCATOR_SETTINGS[s] for s in settings}, "rows": rows}, indent=1) + "\n")
    print(f"planner_on_gpu: wrote {path}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

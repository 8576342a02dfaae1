"""The caching allocator's reserve over the tensors: the trainer's peak reserved against its peak allocated memory.

The planner estimates tensors (what ``torch.cuda.max_memory_allocated`` reports); published peaks such as
torchtitan's are the allocator's reserved memory (``max_memory_reserved``), which also holds the cached blocks
that fragmentation leaves. This script measures the difference on the trainer's own runs, under the allocator's
default setting and under ``expandable_segments:True`` (what torchtitan's launch scripts set), so that the
validation page can say how much of a gap to a published figure the reserve can explain.

Each row runs ``schedlang.train`` in a process of its own (the allocator setting is read when CUDA starts) and
reads both peaks after the run returns. ``python bench/allocator_reserve.py --out bench/results/`` writes
``<date>-planner-validation-reserve-<device>-<sha>.json`` with the device, the commit and the versions.
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

from planner_measured import COMMON, ROWS, _versions  # noqa: E402  (the same rows as the measured table)

STEPS = 6
#: the allocator settings compared: torch's default (named: the trainer turns expandable segments on where the
#: environment names no setting) and torchtitan's launch scripts' setting, which is also the trainer's own
ALLOCATOR_SETTINGS = {"default": "expandable_segments:False", "expandable_segments": "expandable_segments:True",
                      "trainer": None}


def _measure_in_this_process(flags: List[str]) -> None:
    """Run the trainer here and print its peak allocated and reserved memory as one JSON line."""
    import torch

    from schedlang.train import main

    main(flags)
    print(json.dumps({"allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                      "reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
                      "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0)}), flush=True)


def run_row(row: Dict, setting: str) -> Dict:
    flags = COMMON + row["flags"] + ["--steps", str(STEPS)]
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if ALLOCATOR_SETTINGS[setting] is not None:  # None: the environment names none, the trainer chooses
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_SETTINGS[setting]
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(flags)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"name": row["name"], "allocator": setting, "flags": flags, "error": done.stderr[-3000:]}
    peaks = json.loads(lines[-1])
    reserve = peaks["reserved_gib"] - peaks["allocated_gib"]
    return {"name": row["name"], "allocator": setting, "flags": row["flags"],
            "allocated_gib": round(peaks["allocated_gib"], 3), "reserved_gib": round(peaks["reserved_gib"], 3),
            "reserve_gib": round(reserve, 3), "reserve_pct": round(100 * reserve / peaks["allocated_gib"], 1),
            "alloc_retries": peaks["alloc_retries"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--sha", default=None, help="the commit measured (default: git rev-parse HEAD)")
    p.add_argument("--only", default=None, help="comma-separated row numbers (from 0) to run; default: every "
                                                "row that fits the GPUs here")
    p.add_argument("--allocator", default=",".join(ALLOCATOR_SETTINGS),
                   help=f"comma-separated allocator settings, of {', '.join(ALLOCATOR_SETTINGS)} (trainer: the "
                        "environment names none and the trainer chooses)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker is not None:
        _measure_in_this_process(json.loads(ns.worker))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("allocator_reserve: needs CUDA", file=sys.stderr)
        return 2
    settings = ns.allocator.split(",")
    unknown = [s for s in settings if s not in ALLOCATOR_SETTINGS]
    if unknown:
        p.error(f"--allocator {','.join(unknown)}: valid settings are {', '.join(ALLOCATOR_SETTINGS)}")
    device = torch.cuda.get_device_name(0)
    sha = ns.sha or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                   text=True).stdout.strip() or "unknown"
    chosen = [ROWS[int(i)] for i in ns.only.split(",")] if ns.only else [r for r in ROWS if r["gpus"] == 1]
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = "h200" if "H200" in device else "h100" if "H100" in device else "gpu"
    path = out / f"{datetime.date.today().isoformat()}-planner-validation-reserve-{slug}-{sha}.json"
    rows: List[Dict] = []
    for setting in settings:
        for row in chosen:
            result = run_row(row, setting)
            rows.append(result)
            print(json.dumps(result)[:400], flush=True)
            # written after every row, so a run stopped at its time limit keeps what it measured
            path.write_text(json.dumps({
                "date": datetime.date.today().isoformat(), "device": device, "git_sha": sha,
                "versions": _versions(), "steps": STEPS, "common_flags": COMMON,
                "what": "the trainer's peak allocated and peak reserved memory of the same run "
                        "(torch.cuda.max_memory_allocated / max_memory_reserved after schedlang.train.main "
                        "returned, one process per row), under each allocator setting: the caching allocator's "
                        "reserve over the tensors. 'trainer': no setting in the environment (the trainer's own choice)",
                "allocator_settings": {s: ALLOCATOR_SETTINGS[s] for s in settings}, "rows": rows}, indent=1) + "\n")
    print(f"allocator_reserve: wrote {path}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

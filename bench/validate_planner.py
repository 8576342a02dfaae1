"""The planner's memory estimate against torchtitan's published peak memory per GPU.

Each row is a LLaMA-3 run torchtitan published (H100s, sequence length 8192, bf16 mixed precision with fp32
master weights and AdamW) with its layout, local batch, activation checkpointing and float8; this script asks
``schedlang train --dry-run --json`` (the trainer's own planner) for the same run and writes

* ``bench/results/<date>-planner-validation.json``: every row's published and estimated GiB, the error, the
  estimate's memory terms, the git commit and the library versions;
* ``docs/planner_validation.rst``: the table, generated from that JSON, with what each term assumes.

``python bench/validate_planner.py`` writes both; ``--check`` regenerates the page from the newest JSON and
fails if the page on disk differs (the docs are current), without running the estimates.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "planner_validation.rst"
#: the goal: every estimate within this share of the published figure
TOLERANCE = 0.10

#: torchtitan's published peak memory per GPU (docs/performance.md of pytorch/torchtitan: H100 80 GB, seq 8192,
#: FSDP2 with bf16 parameters and fp32 reduction, AdamW, torch.compile for the float8 rows); written down before
#: the estimate's formulas were revisited. ``flags`` are schedlang train's flags for the same run.
ROWS: List[Dict] = [
    {"name": "LLaMA-3-8B, 128 GPUs, FSDP 128, local batch 2, selective AC",
     "published_gib": 67.0,
     "flags": ["--config", "8b", "--nodes", "16", "--dp", "128", "--global-batch", "256",
               "--activation-checkpoint", "selective", "--no-compile", "--no-optimize"]},
    {"name": "LLaMA-3-70B, 256 GPUs, FSDP 32 x TP 8, local batch 16, full AC, float8",
     "published_gib": 71.9,
     "flags": ["--config", "70b", "--nodes", "32", "--dp", "32", "--tp", "8", "--sp", "--global-batch", "512",
               "--activation-checkpoint", "full", "--float8", "--compile", "--no-optimize"]},
    {"name": "LLaMA-3.1-405B, 512 GPUs, FSDP 8 x TP 8 x PP 8 (1F1B), local batch 32, full AC, float8",
     "published_gib": 82.5,
     "flags": ["--config", "405b", "--nodes", "64", "--dp", "8", "--tp", "8", "--pp", "8", "--sp",
               "--global-batch", "256", "--microbatches", "32", "--pp-schedule", "1F1B",
               "--activation-checkpoint", "full", "--float8", "--compile", "--no-optimize"]},
    {"name": "LLaMA-3.1-405B, 512 GPUs, FSDP 8 x TP 8 x PP 8 (Interleaved 1F1B), local batch 32, full AC, float8",
     "published_gib": 72.7,
     "flags": ["--config", "405b", "--nodes", "64", "--dp", "8", "--tp", "8", "--pp", "8", "--sp",
               "--global-batch", "256", "--microbatches", "32", "--pp-schedule", "Interleaved1F1B",
               "--stages-per-rank", "2", "--activation-checkpoint", "full", "--float8", "--compile",
               "--no-optimize"]},
]
COMMON = ["--dry-run", "--device", "cuda", "--gpu-memory-gib", "80", "--seq", "8192", "--dtype", "bf16",
          "--optimizer", "adamw"]


def estimate(row: Dict) -> Dict:
    """The dry-run plan of a row (``schedlang train --dry-run --json``, in this process)."""
    from schedlang import train as trainer

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        code = trainer.main([*COMMON, *row["flags"], "--json", str(out)])
        if code != 0:
            raise SystemExit(f"validate_planner: the dry run of {row['name']!r} failed (exit {code})")
        return json.loads(out.read_text())


def run() -> Dict:
    import torch
    import transformers

    rows = []
    for row in ROWS:
        plan = estimate(row)
        error = plan["peak_gib"] / row["published_gib"] - 1
        rows.append({"name": row["name"], "published_gib": row["published_gib"],
                     "estimated_gib": round(plan["peak_gib"], 2), "error_pct": round(100 * error, 1),
                     "within_tolerance": abs(error) <= TOLERANCE, "flags": row["flags"],
                     "layout": plan["layout"]["describe"],
                     "terms_gib": {k: round(v, 2) for k, v in plan["memory_gib"].items()}})
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    import schedlang

    return {"date": datetime.date.today().isoformat(), "git_sha": sha, "torch": torch.__version__,
            "transformers": transformers.__version__, "schedlang": getattr(schedlang, "__version__", ""),
            "tolerance_pct": 100 * TOLERANCE, "common_flags": COMMON, "rows": rows}


def newest_results() -> Path:
    found = sorted(RESULTS.glob("*-planner-validation.json"))
    if not found:
        raise SystemExit("validate_planner: no bench/results/*-planner-validation.json; run "
                         "python bench/validate_planner.py first")
    return found[-1]


ASSUMPTIONS = """\
What the estimate counts, per GPU (``schedlang.autotune.step_cost``), and what each term assumes:

* **Weights, gradients, optimizer state**: fp32 master weights, fp32 gradients and AdamW's two fp32 moments,
  16 bytes per parameter, divided over the FSDP shard group (and the tp ranks, and the pipeline stage).
* **Gathered weights**: FSDP2 gathers each layer's bf16 weights just before it runs; two layers are in flight
  (the one running and the one prefetched), plus the embedding and output head, which the root unit keeps.
  With pipelining, the stage's weights stay gathered from the first backward to the end of the step and its
  gradients accumulate unsharded in the reduce dtype (fp32) until the last microbatch, as
  ``torch.distributed.pipelining`` runs FSDP2. Float8 adds a layer's float8 weight and its transpose.
* **Activations**: counted tensor by tensor for a LLaMA layer. Full checkpointing keeps each layer's input
  (bf16, split over the tp ranks by sequence parallelism); selective keeps also every other matmul's output,
  attention's output and its log-sum-exp. A pipeline rank holds the microbatches its schedule has in flight.
  One layer's full activations are in flight while it is recomputed and differentiated.
* **Logits and loss**: the bf16 logits, their fp32 copy and the fp32 log-softmax (10 bytes per vocabulary
  entry and token, over the tp ranks), for vocabulary 128,256.
* **Workspace**: 0.5 GiB (cuBLAS workspace, NCCL buffers outside the caching allocator's count).
* **Not modelled**: the caching allocator's reserve beyond what tensors use (fragmentation). torchtitan reports
  ``torch.cuda.max_memory_reserved``; the estimate is of allocated memory (what
  ``bench/train_memory.py`` checks the estimate against on this trainer, within 15%), so a published figure
  above the estimate by a few GiB is the reserve this model leaves out on purpose rather than fit with a constant.
"""


def render(data: Dict) -> str:
    """The docs page of a results JSON."""
    title = "Planner validation: memory per GPU against torchtitan's published runs"
    # orphan: the page is linked from the docs' index by hand; until then sphinx must not call it unreachable
    lines = [":orphan:", "", ".. This page is generated by bench/validate_planner.py; do not edit it by hand.", "",
             title, "=" * len(title), "",
             f"``schedlang train --dry-run`` estimates the peak memory per GPU of a layout before anything runs. "
             f"The table compares it with the peak memory torchtitan published for LLaMA-3 runs on H100s "
             f"(sequence length 8192). Goal: every row within {data['tolerance_pct']:.0f}%.", "",
             f"Generated from ``{newest_results().relative_to(ROOT)}`` (schedlang commit ``{data['git_sha'][:12]}``, "
             f"torch {data['torch']}, transformers {data['transformers']}).", "",
             ".. list-table::", "   :header-rows: 1", "",
             "   * - Run", "     - Published (GiB)", "     - Estimated (GiB)", "     - Error", "     - Layout"]
    for row in data["rows"]:
        lines += [f"   * - {row['name']}", f"     - {row['published_gib']:.1f}", f"     - {row['estimated_gib']:.1f}",
                  f"     - {row['error_pct']:+.1f}%" + ("" if row["within_tolerance"] else " (outside the goal)"),
                  f"     - ``{row['layout']}``"]
    lines += ["", "Error = estimated / published - 1. The flags of each row are in the JSON (``flags``, after "
              "``common_flags``); every row runs ``schedlang train`` with them.", "", ASSUMPTIONS]
    missed = [r for r in data["rows"] if not r["within_tolerance"]]
    if missed:
        lines += ["Rows outside the goal", "---------------------", ""]
        for r in missed:
            lines.append(f"* {r['name']}: {r['error_pct']:+.1f}% (estimated {r['estimated_gib']:.1f} GiB, published "
                         f"{r['published_gib']:.1f} GiB). {r.get('why_missed', '')}".rstrip())
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/planner_validation.rst is not the page "
                        "of the newest results")
    args = parser.parse_args(argv)
    if args.check:
        data = json.loads(newest_results().read_text())
        if not PAGE.is_file() or PAGE.read_text() != render(data):
            print(f"validate_planner: {PAGE} is not current; run python bench/validate_planner.py",
                  file=sys.stderr)
            return 1
        return 0
    data = run()
    for row in data["rows"]:
        row["why_missed"] = MISSES.get(row["name"], "") if not row["within_tolerance"] else ""
    out = RESULTS / f"{data['date']}-planner-validation.json"
    out.write_text(json.dumps(data, indent=2) + "\n")
    PAGE.write_text(render(data))
    for row in data["rows"]:
        print(f"{row['published_gib']:6.1f} {row['estimated_gib']:6.1f} {row['error_pct']:+6.1f}%  {row['name']}")
    return 0


#: why a row misses the goal, where it does (written after looking at the estimate's terms)
_PIPELINE_MISS = (
    "The estimate's largest terms here are the pipeline's FSDP2 state: the stage's weights kept gathered in bf16 "
    "(12.9 GiB) and its gradients accumulated unsharded in fp32 (24.3 GiB) besides the sharded master weights, "
    "gradients and AdamW state (12.2 GiB); the activations kept by full checkpointing are 6 to 8 GiB. The "
    "published 1F1B figure is 9.8 GiB above the interleaved one, while both schedules as modelled hold the same "
    "weights and the interleaved one more activations (its first rank runs 23 forwards of 8 layers before its "
    "first backward, against 1F1B's 8 of 16): the published order is the reverse, so the gap is not in the terms "
    "this model counts. What the published runs hold besides (the stage split of 126 layers, the pipeline's "
    "send and receive buffers, the caching allocator's reserve over 32 microbatches) is not published with the "
    "figures, and no constant is fitted to close it.")
MISSES: Dict[str, str] = {ROWS[2]["name"]: _PIPELINE_MISS, ROWS[3]["name"]: _PIPELINE_MISS}

if __name__ == "__main__":
    sys.exit(main())

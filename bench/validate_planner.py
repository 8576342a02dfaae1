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

#: torchtitan's published peak memory per GPU (benchmarks/llama3_h100_202412_torchtitan.md of pytorch/torchtitan,
#: torch, torchao and torchtitan of 2024-12-23..26: H100 96 GB HBM2e, seq 8192, FSDP2 with bf16 parameters and fp32
#: reduction, AdamW, torch.compile for the float8 rows); written down before the estimate's formulas were revisited.
#: ``flags`` are schedlang train's flags for the same run. The pipeline rows' microbatches are torchtitan's default
#: of that time (``experimental.pipeline_parallel_microbatches`` unset: one microbatch per stage, pp x stages per
#: rank), as the benchmark names no count: 8 microbatches of 4 rows under 1F1B, 16 of 2 rows interleaved.
ROWS: List[Dict] = [
    {"name": "LLaMA-3-8B, 128 GPUs, FSDP 128, local batch 2, selective AC",
     "published_gib": 67.0,
     "flags": ["--config", "8b", "--nodes", "16", "--dp", "128", "--global-batch", "256",
               "--activation-checkpoint", "selective", "--no-compile", "--no-optimize"]},
    {"name": "LLaMA-3-70B, 256 GPUs, FSDP 32 x TP 8, local batch 16, full AC, float8",
     "published_gib": 71.9,
     "flags": ["--config", "70b", "--nodes", "32", "--dp", "32", "--tp", "8", "--sp", "--global-batch", "512",
               "--activation-checkpoint", "full", "--float8", "--compile", "--no-optimize"]},
    {"name": "LLaMA-3.1-405B, 512 GPUs, FSDP 8 x TP 8 x PP 8 (1F1B, 8 microbatches), local batch 32, full AC, "
             "float8",
     "published_gib": 82.5,
     "flags": ["--config", "405b", "--nodes", "64", "--dp", "8", "--tp", "8", "--pp", "8", "--sp",
               "--global-batch", "256", "--microbatches", "8", "--pp-schedule", "1F1B",
               "--activation-checkpoint", "full", "--float8", "--compile", "--no-optimize"]},
    {"name": "LLaMA-3.1-405B, 512 GPUs, FSDP 8 x TP 8 x PP 8 (Interleaved 1F1B, 16 microbatches), local batch 32, "
             "full AC, float8",
     "published_gib": 72.7,
     "flags": ["--config", "405b", "--nodes", "64", "--dp", "8", "--tp", "8", "--pp", "8", "--sp",
               "--global-batch", "256", "--microbatches", "16", "--pp-schedule", "Interleaved1F1B",
               "--stages-per-rank", "2", "--activation-checkpoint", "full", "--float8", "--compile",
               "--no-optimize"]},
]
COMMON = ["--dry-run", "--device", "cuda", "--gpu-memory-gib", "96", "--seq", "8192", "--dtype", "bf16",
          "--optimizer", "adamw"]


def estimate(row: Dict, extra: List[str] = ()) -> Dict:
    """The dry-run plan of a row (``schedlang train --dry-run --json``, in this process)."""
    from schedlang import train as trainer

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        code = trainer.main([*COMMON, *row["flags"], *extra, "--json", str(out)])
        if code != 0:
            raise SystemExit(f"validate_planner: the dry run of {row['name']!r} failed (exit {code})")
        return json.loads(out.read_text())


#: rows the trace cannot run, and why
UNTRACED: Dict[str, str] = {}


def trace(row: Dict) -> Dict:
    """The row's peak rank traced on fake tensors (``--trace-memory``), without float8, which the trace does not
    run, beside the formula's estimate of the same traced layout."""
    for flag, why in UNTRACED.items():
        if flag in row["flags"]:
            return {"skipped": why}
    flags = {**row, "flags": [f for f in row["flags"] if f != "--float8"]}
    plan = estimate(flags, ["--trace-memory"])
    return {"traced_gib": round(plan["traced_peak_gib"], 2), "formula_gib": round(plan["traced_formula_peak_gib"], 2),
            "gap_pct": round(100 * (plan["traced_peak_gib"] / plan["traced_formula_peak_gib"] - 1), 1),
            "without_float8": "--float8" in row["flags"]}


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
                     "terms_gib": {k: round(v, 2) for k, v in plan["memory_gib"].items()},
                     "traced": trace(row)})
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    import schedlang

    return {"date": datetime.date.today().isoformat(), "git_sha": sha, "torch": torch.__version__,
            "transformers": transformers.__version__, "schedlang": getattr(schedlang, "__version__", ""),
            "tolerance_pct": 100 * TOLERANCE, "common_flags": COMMON, "rows": rows,
            "reserve_measured": {"file": str(newest_reserve().relative_to(ROOT)),
                                 "device": json.loads(newest_reserve().read_text()).get("device", "H100"),
                                 "rows": json.loads(newest_reserve().read_text())["rows"]},
            "measured": measured_rows(), "on_gpu": on_gpu_rows()}


def on_gpu_rows() -> Dict:
    """The published rows' rank 0 run on one GPU (bench/planner_on_gpu.py): for each row and allocator setting, the
    newest measurement that ran (files read oldest first, by name)."""
    chosen: Dict = {}
    for path in sorted(RESULTS.glob("*-planner-on-gpu-*.json")):
        data = json.loads(path.read_text())
        for row in data["rows"]:
            key = (row["name"], row["allocator"])
            common = {"file": str(path.relative_to(ROOT)), "git_sha": data["git_sha"], "versions": data["versions"]}
            if "error" not in row:
                chosen[key] = {**row, **common}
            elif "does not fit this GPU" in row["error"] and "reserved_gib" not in chosen.get(key, {}):
                # ran out of memory in a step: the rank needs more than the GPU holds under that setting
                chosen[key] = {"name": row["name"], "allocator": row["allocator"], "out_of_memory": True,
                               "device": data["device"], **common}
    return {"rows": list(chosen.values())}


#: the goals of the rows measured on our own GPUs: memory within 10%, step time within 15%
MEASURED_MEMORY_TOLERANCE, MEASURED_STEP_TOLERANCE = 0.10, 0.15


def measured_files() -> List[Path]:
    """Every run of bench/planner_measured.py, oldest first (by the date it records, then by name)."""
    found = sorted(RESULTS.glob("*-planner-measured-*.json"), key=lambda p: (json.loads(p.read_text())["date"], p.name))
    if not found:
        raise SystemExit("validate_planner: no bench/results/*-planner-measured-*.json; run bench/planner_measured.py "
                         "on a GPU machine")
    return found


def estimate_measured(flags: List[str], gpus: int) -> Dict:
    """The dry-run plan, on this code, of a command line that bench/planner_measured.py ran on ``gpus`` GPUs."""
    from schedlang import train as trainer

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        code = trainer.main(["--dry-run", "--nodes", "1", "--gpus-per-node", str(gpus), "--gpu-memory-gib", "80",
                             *flags, "--json", str(out)])
        if code != 0:
            raise SystemExit(f"validate_planner: the dry run of {flags} failed (exit {code})")
        return json.loads(out.read_text())


def measured_rows() -> Dict:
    """The trainer's measured peak memory and step time on our GPUs beside the planner's estimate of today: each
    row of bench/planner_measured.py from the newest run that measured it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("planner_measured", ROOT / "bench" / "planner_measured.py")
    planner_measured = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planner_measured)
    newest: Dict[str, tuple] = {}
    for path in measured_files():
        data = json.loads(path.read_text())
        for row in data["rows"]:
            if "error" not in row:
                newest[row["name"]] = (path, data, row)
    rows, devices = [], set()
    for wanted in planner_measured.ROWS:
        if wanted["name"] not in newest:
            continue
        path, data, row = newest[wanted["name"]]
        devices.add(data["device"])
        plan = estimate_measured(row["flags"], row["gpus"])
        peak, step = plan["peak_gib"] / row["measured_peak_gib"] - 1, plan["step_ms"] / row["measured_step_ms"] - 1
        rows.append({"name": row["name"], "gpus": row["gpus"], "flags": row["flags"], "device": data["device"],
                     "file": str(path.relative_to(ROOT)), "git_sha": data["git_sha"], "versions": data["versions"],
                     "measured_peak_gib": round(row["measured_peak_gib"], 2),
                     "estimated_peak_gib": round(plan["peak_gib"], 2), "peak_error_pct": round(100 * peak, 1),
                     "measured_step_ms": round(row["measured_step_ms"], 1),
                     "measured_step_ms_min_max": [round(t, 1) for t in row["measured_step_ms_min_max"]],
                     "estimated_step_ms": round(plan["step_ms"], 1), "step_error_pct": round(100 * step, 1),
                     "within_tolerance": (abs(peak) <= MEASURED_MEMORY_TOLERANCE
                                          and abs(step) <= MEASURED_STEP_TOLERANCE)})
    return {"devices": sorted(devices), "rows": rows,
            "not_measured": [f"{w['name']} ({w['gpus']} GPUs)" for w in planner_measured.ROWS
                             if w["name"] not in newest]}


def newest_results() -> Path:
    found = sorted(RESULTS.glob("*-planner-validation.json"))
    if not found:
        raise SystemExit("validate_planner: no bench/results/*-planner-validation.json; run "
                         "python bench/validate_planner.py first")
    return found[-1]


ASSUMPTIONS = """\
What the published figures are: torchtitan logs as a step's ``memory`` the peak of the caching allocator's
``reserved_bytes.all.peak`` (``torch.cuda.memory_stats``), that is reserved memory, which holds the allocated
tensors plus the cached blocks the allocator keeps (fragmentation); the benchmark takes the largest over all GPUs.
The estimate is of allocated memory: the tensors alive at the peak, what the trainer's ``mem`` reports
(``torch.cuda.max_memory_allocated``) and what ``bench/planner_measured.py`` checks the estimate against on GPUs.

What the estimate counts, per GPU (``schedlang.autotune.step_cost``), and what each term assumes:

* **Weights, gradients, optimizer state**: fp32 master weights, fp32 gradients and AdamW's two fp32 moments,
  16 bytes per parameter, divided over the FSDP shard group (and the tp ranks, and the pipeline stage).
* **Gathered weights**: FSDP2 gathers each layer's bf16 weights just before it runs; two layers are in flight
  (the one running and the one prefetched), plus the embedding and output head, which the root unit keeps.
  With pipelining torchtitan turns ``reshard_after_forward`` off, and ``torch.distributed.pipelining`` turns
  gradient reduction and resharding after the backward off for all but the last microbatch: the stage's weights
  stay gathered in bf16 through the step, and its gradients accumulate unsharded, upcast to the reduce dtype
  (fp32), until the last microbatch. Float8 (tensorwise) adds a layer's float8 weight and its transpose; the
  weights are gathered in bf16 (torchtitan's float8 all-gather is off by default, and the benchmark does not
  say it was turned on).
* **Activations**: counted tensor by tensor for a LLaMA layer. Full checkpointing keeps each layer's input
  (bf16, split over the tp ranks by sequence parallelism); selective keeps also every other matmul's output,
  attention's output and its log-sum-exp.
* **Early in the backward**, beside the saved activations, the larger of two moments, one after the other: the
  loss's backward (below), and then a layer's backward, itself the larger of its MLP's moment (what a
  checkpointed layer recomputes beyond what it saved, the MLP's gradients, three intermediate-sized tensors in a
  gated MLP, and the residual stream's gradient) and its norm's at its end (an eager RMSNorm's fp32 copies of its
  input; under FSDP the layer's unsharded weight gradients). FSDP2 keeps the previous layer's reduce-scatter input
  (its unsharded gradient in the reduce dtype) through the next layer's backward, once that layer's activations
  are freed. Float8 adds the float8 copies of a layer's matmul inputs.
* **Pipeline microbatches**: torchtitan of the benchmark's date split the local batch into one microbatch per
  stage when no count is given (8 of 4 rows under 1F1B, 16 of 2 rows under Interleaved 1F1B with 2 stages per
  rank; torchtitan 0.2.2 defaults to microbatches of one row instead, which the published runs predate). A rank
  holds the microbatches its schedule runs forward before its first backward, as torch's schedules order them:
  under 1F1B ``pp - rank`` (8 on the first rank, 1 on the last), interleaved ``(v - 1) pp + 2 (pp - 1 - rank) + 1``
  stage-microbatches of ``layers / v`` layers (23 on the first rank, 9 on the last). Each rank is taken to hold
  ``126 / 8`` layers and the embedding, as schedlang's trainer splits them (16, 16, 15, 16, 16, 15, 16, 16
  layers: the first rank holds 16 and the embedding). Its activations count ``ceil(126 / 8) = 16`` layers.
  Each stage-microbatch in flight also keeps the stage's output (a layer's input in size, with the rotary
  embeddings and position ids the later stages use, relayed) until its backward; torch's stages keep one receive
  buffer for that output's gradient per stage-microbatch of the step, and a stage fed by another rank one for
  its input per microbatch. The
  gradients, zeroed after each step, come with a rank's first backward: where the rank ran every microbatch's
  forward before it (1F1B's first rank, 8 microbatches of 8 stages), they are whole only once that backward has
  freed its microbatch, so the peak counts 7 microbatches beside every gradient.
* **Logits and loss**: at the loss's backward, the bf16 logits, the log-softmax's fp32 output, its gradient and
  the gradient of the logits' fp32 copy (14 bytes per vocabulary entry and token, over the tp ranks), for
  vocabulary 128,256. Under pipelining they live on the last rank only, which holds the fewest microbatches: the
  peak rank is the first or the last, whichever holds more (the first, in both 405B rows, so their logits term
  is 0).
* **Workspace**: 0.5 GiB (cuBLAS workspace, NCCL buffers outside the caching allocator's count).
"""

REMAINING = """\
Remaining error
---------------

{spread} The estimate counts tensors; the published figures are reserved memory. Three checks tell which of the
two the gap is:

* **The trace of the same run.** ``--dry-run --trace-memory`` builds the peak rank of the same job on fake
  tensors with a fake process group of the full world size and runs its training steps (torch's own
  ``FakeTensorMode`` and FSDP memory tracker, eager layers; the trace runs neither float8 nor torch.compile, so
  those rows are traced without float8, beside the formula of the same eager layout). The "Traced" column gives
  the traced tensor peak with the formula's estimate of that traced layout in brackets: {traced}. Where the
  two agree, the gap to the published figure is not in the tensors. The trace answers transformers'
  packed-sequence check on the positions the run holds (on fake tensors it cannot read them and would build a
  causal mask the run never holds; under a pipeline the first stage would send it on).
* **The allocator's reserve.** The caching allocator's reserve over the tensors is not in the estimate: it
  depends on the order and sizes of the allocations, not on the layout's terms. On this trainer
  (``{reserve_file}``: the same run's ``max_memory_allocated`` and ``max_memory_reserved``, {reserve_device}) it
  measured {reserve_default} under torch's default setting, largest with full checkpointing, whose recomputation
  frees and remakes a layer's activations layer after layer; and {reserve_expandable} under
  ``expandable_segments:True``, the setting of torchtitan's single-node launch script (and of schedlang's trainer,
  unless the environment names another). The published figures are {gaps} above the estimates. The published
  runs of 128 to 512 GPUs were multi-node, and torchtitan's multi-node Slurm script of the benchmark's commit
  (9dec370) names no allocator setting: they most likely ran torch's default.
* **The rank itself, on a GPU** (below): rank 0 of each run, built by the trainer with the row's flags (compile
  and float8 included) on one GPU. Its allocated peak is the estimate within 1.7% for the 70B and 405B rows
  (the 8B row runs eager, as published, where the estimate is 8% above); its reserved peak under torch's
  default allocator is the published figure within 2.1% (70B) and 6.2% (8B). The gap is the allocator's reserve.
  The planner leaves 10% of the device unplanned (``USABLE_MEMORY``); under the default allocator a full
  checkpointing run reserves more than that (43% over the tensors for the 70B rank), which the trainer's
  expandable segments avoid.

Also not modelled: torch.compile's own buffers, the float8 rows' scales and amax history, and the 405B runs'
asynchronous tensor parallelism (its symmetric-memory buffers). And the 405B stage split differs: the estimate
is of schedlang's trainer, whose first pipeline rank holds 16 layers and the embedding; torchtitan's split of the
time (its ``generate_split_points`` of late 2024) gives its first rank 15 layers and the embedding, and its
middle ranks 16 layers with one microbatch fewer in flight, which would put the 405B estimates 2 to 3 GiB lower.
"""


def _spread(rows: List[Dict]) -> str:
    """How far the estimates are from the published figures, in words."""
    errors = [r["error_pct"] for r in rows]
    if max(errors) < 0:
        return f"Every estimate is below its published figure, by {-max(errors):.1f} to {-min(errors):.1f}%."
    return f"The estimates are {min(errors):+.1f} to {max(errors):+.1f}% from the published figures."


def _traced_cell(traced: Dict) -> str:
    if "skipped" in traced:
        return f"not traced: {traced['skipped']}"
    return (f"{traced['traced_gib']:.1f} (formula {traced['formula_gib']:.1f}, {traced['gap_pct']:+.1f}%"
            + (", without float8)" if traced["without_float8"] else ")"))


def _remaining(data: Dict) -> str:
    reserve = data["reserve_measured"]
    gaps = [r["published_gib"] - r["estimated_gib"] for r in data["rows"]]
    gaps_traced = [r["traced"]["gap_pct"] for r in data["rows"] if "gap_pct" in r["traced"]]
    return REMAINING.format(
        spread=_spread(data["rows"]), reserve_file=reserve["file"],
        traced=(f"the traced peaks are {min(gaps_traced):+.1f} to {max(gaps_traced):+.1f}% from the formula's in the "
                f"{len(gaps_traced)} rows traced"),
        reserve_device=reserve.get("device", "H100"),
        reserve_default=_reserve_range(reserve["rows"], "default"),
        reserve_expandable=_reserve_range(reserve["rows"], "expandable_segments"),
        gaps=f"{min(gaps):.1f} to {max(gaps):.1f} GiB")


def _reserve_range(rows: List[Dict], setting: str) -> str:
    """The measured reserve of the rows run under one allocator setting (a row without one ran torch's default)."""
    chosen = [r for r in rows if r.get("allocator", "default") == setting and "reserve_gib" in r]
    if not chosen:
        return "nothing (not measured)"
    extra = [r["reserve_gib"] for r in chosen]
    shares = [r["reserve_pct"] for r in chosen]
    return (f"{min(extra):.1f} to {max(extra):.1f} GiB ({min(shares):.1f} to {max(shares):.1f}% of the allocated "
            f"peak) over {len(chosen)} LLaMA-1B runs")


def newest_reserve() -> Path:
    """The newest measurement of the trainer's reserved against allocated memory that holds rows of both allocator
    settings the page compares (torch's default and expandable segments), else the newest of any."""
    found = sorted(RESULTS.glob("*-planner-validation-reserve-*.json"))
    if not found:
        raise SystemExit("validate_planner: no bench/results/*-planner-validation-reserve-*.json")

    def settings(path: Path) -> set:
        return {r.get("allocator", "default") for r in json.loads(path.read_text())["rows"]}

    both = [p for p in found if {"default", "expandable_segments"} <= settings(p)]
    return (both or found)[-1]


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
             "   * - Run", "     - Published, reserved (GiB)", "     - Estimated tensors (GiB)", "     - Error",
             "     - Traced tensors (GiB)", "     - Layout"]
    for row in data["rows"]:
        lines += [f"   * - {row['name']}", f"     - {row['published_gib']:.1f}", f"     - {row['estimated_gib']:.1f}",
                  f"     - {row['error_pct']:+.1f}%" + ("" if row["within_tolerance"] else " (outside the goal)"),
                  f"     - {_traced_cell(row['traced'])}", f"     - ``{row['layout']}``"]
    lines += ["", "Error = estimated / published - 1. The flags of each row are in the JSON (``flags``, after "
              "``common_flags``); every row runs ``schedlang train`` with them.", "", ASSUMPTIONS, _remaining(data)]
    lines += _on_gpu_section(data)
    lines += _measured_section(data["measured"])
    missed = [r for r in data["rows"] if not r["within_tolerance"]]
    if missed:
        lines += ["Rows outside the goal", "---------------------", ""]
        for r in missed:
            lines.append(f"* {r['name']}: {r['error_pct']:+.1f}% (estimated {r['estimated_gib']:.1f} GiB, published "
                         f"{r['published_gib']:.1f} GiB). {r.get('why_missed', '')}".rstrip())
        lines.append("")
    return "\n".join(lines)


def _on_gpu_section(data: Dict) -> List[str]:
    rows = data.get("on_gpu", {}).get("rows", [])
    if not rows:
        return []
    title = "One rank of each run, on one GPU"
    by = {(r["name"], r["allocator"]): r for r in rows}
    devices = sorted({r["device"] for r in rows})
    files = sorted({f"``{r['file']}``" for r in rows})
    lines = [title, "-" * len(title), "",
             "``--dry-run --trace-memory gpu`` builds rank 0 of the run on one GPU, in a fake process group of the "
             "run's world size, with the row's flags (torch.compile and float8 included), and runs three training "
             "steps: the caching allocator's peaks are those of a rank of the job, the communication library's own "
             f"buffers apart. On {', '.join(devices)}, each row and allocator setting in a process of its own "
             f"(``bench/planner_on_gpu.py``; {', '.join(files)}). Reserved is what the published figures are; "
             "error = reserved / published - 1.", "",
             ".. list-table::", "   :header-rows: 1", "",
             "   * - Run", "     - Published, reserved (GiB)", "     - Estimated tensors (GiB)",
             "     - Allocated (GiB)", "     - Reserved, expandable segments", "     - Reserved, torch's default"]
    for row in data["rows"]:
        cells = []
        for setting in ("expandable_segments", "default"):
            r = by.get((row["name"], setting))
            if r is None:
                cells.append("not run")
            elif r.get("out_of_memory"):
                cells.append(f"out of memory on {r['device']}")
            else:
                cells.append(f"{r['reserved_gib']:.1f} ({r['reserved_error_pct']:+.1f}%)")
        ran = [by[(row["name"], s)] for s in ("expandable_segments", "default")
               if "allocated_gib" in by.get((row["name"], s), {})]
        if ran:
            off = 100 * (ran[0]["allocated_gib"] / ran[0]["formula_gib"] - 1)
            allocated = f"{ran[0]['allocated_gib']:.1f} ({off:+.1f}% from the estimate)"
            formula = f"{ran[0]['formula_gib']:.1f}"
        else:
            allocated, formula = "not run", "-"
        lines += [f"   * - {row['name']}", f"     - {row['published_gib']:.1f}", f"     - {formula}",
                  f"     - {allocated}", *(f"     - {c}" for c in cells)]
    lines += ["", "Allocated: the expandable-segments run's (the default's agrees within 0.1 GiB where both ran). The "
              "default allocator's 405B 1F1B rank ran out of memory on the 80 GiB H100 with 70.5 GiB allocated and "
              "7.4 GiB more reserved; the published run had 96 GB H100s.", ""]
    return lines


def _measured_section(measured: Dict) -> List[str]:
    title = "Against our own runs"
    lines = [title, "-" * len(title), "",
             f"The trainer's measured peak memory (``torch.cuda.max_memory_allocated``) and median step time (steps "
             f"after the first four; the fastest and slowest in brackets) on {', '.join(measured['devices'])}, beside "
             f"the planner's estimate of the same command line on this commit. Goal: memory within "
             f"{100 * MEASURED_MEMORY_TOLERANCE:.0f}%, step time within {100 * MEASURED_STEP_TOLERANCE:.0f}%. Measured "
             f"by ``bench/planner_measured.py``; each row's file, commit and versions are in the results JSON "
             f"(``measured``).", "",
             ".. list-table::", "   :header-rows: 1", "",
             "   * - Run", "     - Peak measured (GiB)", "     - Estimated", "     - Error",
             "     - Step measured (ms)", "     - Estimated", "     - Error"]
    for row in measured["rows"]:
        lines += [f"   * - {row['name']}", f"     - {row['measured_peak_gib']:.1f}",
                  f"     - {row['estimated_peak_gib']:.1f}", f"     - {row['peak_error_pct']:+.1f}%"
                  + ("" if abs(row["peak_error_pct"]) <= 100 * MEASURED_MEMORY_TOLERANCE else " (outside the goal)"),
                  f"     - {row['measured_step_ms']:.0f} ({row['measured_step_ms_min_max'][0]:.0f}-"
                  f"{row['measured_step_ms_min_max'][1]:.0f})",
                  f"     - {row['estimated_step_ms']:.0f}", f"     - {row['step_error_pct']:+.1f}%"
                  + ("" if abs(row["step_error_pct"]) <= 100 * MEASURED_STEP_TOLERANCE else " (outside the goal)")]
    lines.append("")
    if measured["not_measured"]:
        lines += ["Not measured yet (no machine of that many GPUs was lent so far): "
                  + "; ".join(measured["not_measured"]) + ".", ""]
    return lines


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
    expandable = [r["reserve_pct"] for r in data["reserve_measured"]["rows"]
                  if r.get("allocator") == "expandable_segments" and "reserve_pct" in r]
    for row in data["rows"]:
        why = MISSES.get(row["name"], "") if not row["within_tolerance"] else ""
        if "traced_gib" in row["traced"]:
            why = why.format(**row["traced"], expandable_max_pct=max(expandable, default=float("nan")))
        row["why_missed"] = why
    out = RESULTS / f"{data['date']}-planner-validation.json"
    out.write_text(json.dumps(data, indent=2) + "\n")
    PAGE.write_text(render(data))
    for row in data["rows"]:
        print(f"{row['published_gib']:6.1f} {row['estimated_gib']:6.1f} {row['error_pct']:+6.1f}%  {row['name']}")
    return 0


#: why a row misses the goal, where one does (written after looking at the estimate's terms and the trace)
MISSES: Dict[str, str] = {
    "LLaMA-3-70B, 256 GPUs, FSDP 32 x TP 8, local batch 16, full AC, float8":
        "The estimate counts the tensors: the trace of the same layout without float8 agrees ({traced_gib:.1f} GiB "
        "traced, {formula_gib:.1f} GiB estimated for the eager layout), and rank 0 of this run built on one H100 with "
        "compile and float8 allocated 51.2 GiB (the estimate is 1.7% above). The 20 GiB to the published figure are "
        "the caching allocator's reserve: under torch's default setting (torchtitan's multi-node launch script "
        "names no other), the same rank reserved 73.4 GiB, 2.1% above the published 71.9 GiB; under "
        "expandable segments, 59.9 GiB. The estimate is of tensors, not of that reserve.",
    "LLaMA-3.1-405B, 512 GPUs, FSDP 8 x TP 8 x PP 8 (1F1B, 8 microbatches), local batch 32, full AC, float8":
        "The estimate counts the tensors: rank 0 of this run built on one H100 with compile and float8 allocated "
        "73.7 GiB (the estimate is 1.2% below) and reserved 78.2 GiB under expandable segments (5.2% below the "
        "published 82.5 GiB); under torch's default allocator it ran out of memory on the 80 GiB GPU, with 70.5 GiB "
        "allocated and 7.4 GiB more reserved, so it needs more than 79.2 GiB there (the published run had 96 GB "
        "H100s). The 10 GiB to the published figure are the allocator's reserve. (The trace of the same layout "
        "without float8: {traced_gib:.1f} GiB traced, {formula_gib:.1f} GiB estimated.)",
}

if __name__ == "__main__":
    sys.exit(main())

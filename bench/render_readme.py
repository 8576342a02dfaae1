"""Render the README's Performance table and chart from the result files in ``bench/results/``, only.

    python bench/render_readme.py                 # rewrite README.md between the markers, write the chart
    python bench/render_readme.py --check         # exit 1 if README.md is not what the results give

Reads every ``bench/results/*.json`` written through ``bench/harness.py`` by a GPU run (files
with ``gpus`` > 0; ``--tiny`` runs on the CPU are left out). For each work the rows of its newest
file are shown; every row gives its time, tokens/s and MFU, its speed against the baseline it
names (``baseline``; else the work's fastest baseline) from the same file, the check, and the
device, date and git revision of that file. The training works of ``bench/bench_train.py`` without
a GPU result say so. Nothing is typed in by hand: to change a figure, run the benchmark again.

The table replaces the text between ``<!-- perf-table:start -->`` and ``<!-- perf-table:end -->``;
the chart (``bench/results/perf.png``, matplotlib) shows each row's speed against its baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/harness.py)

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
#: the training works of bench_train.py, in the order the table lists them (kept here so that rendering
#: needs neither torch nor transformers; a test checks it against bench_train.WORKS)
TRAIN_WORKS = ("llama-1.1b-1gpu", "gpt2-medium-1gpu", "llama-1.1b-1gpu-fp8", "llama-1.1b-1gpu-ckpt", "llama-1.1b-tp2",
               "llama-1.1b-2gpu", "llama-1.1b-2gpu-fp8", "llama-8b-layers-2gpu", "llama-8b-4gpu")
NO_RESULT = "no GPU results recorded for the current code yet"


def load_results(directory: Path) -> List[dict]:
    """The GPU result files in ``directory``, each ``{"path", "header", "rows"}``, oldest first."""
    out = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not data.get("gpus"):
            continue
        header = {k: v for k, v in data.items() if k != "rows"}
        out.append({"path": path, "header": header, "rows": data["rows"]})
    # newest last: by date, then the time a run wrote its file (files of older runs have none), then name
    out.sort(key=lambda f: (str(f["header"].get("date", "")), str(f["header"].get("time", "")), f["path"].name))
    return out


def latest_rows(files: Sequence[dict]) -> Dict[str, Tuple[dict, List[dict]]]:
    """Per work, the header and rows of the newest file that has it."""
    works: Dict[str, Tuple[dict, List[dict]]] = {}
    for f in files:
        by_work: Dict[str, List[dict]] = {}
        for r in f["rows"]:
            by_work.setdefault(str(r.get("work")), []).append(r)
        for work, rows in by_work.items():
            works[work] = (f["header"], rows)
    return works


def work_order(works) -> List[str]:
    """The training works in TRAIN_WORKS's order, then every other work with results, sorted."""
    return list(TRAIN_WORKS) + sorted(w for w in works if w not in TRAIN_WORKS)


def same_run(row: dict, rows: Sequence[dict], header: dict) -> List[dict]:
    """The rows measured by the same command on the same revision as ``row``: a ratio compares only
    rows of one run (one process, like for like), never rows merged in from another day's code."""
    def run(r):
        return (r.get("git_sha") or header.get("git_sha"), r.get("command") or header.get("command"))

    return [r for r in rows if run(r) == run(row)]


def _fmt(value, kind: str) -> str:
    return harness._fmt(value, kind)


def _clock(sample: Optional[dict]) -> str:
    """A row's GPU clock over its timed steps: mean SM MHz, mean power, share of samples power-capped, and the
    energy per step where the driver's counter was read."""
    if not sample:
        return "-"
    text = f"{sample['sm_mhz']:.0f} MHz, {sample['power_w']:.0f} W, {sample['power_capped']:.0%} capped"
    if sample.get("j_per_step") is not None:
        text += f", {sample['j_per_step']:.1f} J/step"
    return text


def render_table(files: Sequence[dict]) -> str:
    works = latest_rows(files)
    head = ["work", "variant", "role", "step ms", "tokens/s", "MFU", "peak GiB", "vs baseline", "vs fastest baseline",
            "optimizer", "check", "GPU clock", "device", "date", "sha"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    for work in work_order(works):
        if work not in works:
            lines.append(f"| {work} | {NO_RESULT} |" + " |" * (len(head) - 2))
            continue
        header, rows = works[work]
        if all(_is_memory_row(r) for r in rows):  # the memory table's
            continue
        for r in rows:
            sha = str(r.get("git_sha") or header.get("git_sha", "unknown"))
            sha = sha[:10] + ("+dirty" if sha.endswith("+dirty") else "")
            run = same_run(r, rows, header)
            ratio = harness.ratio_to_baseline(r, run)
            vs = "-" if ratio is None else f"{ratio:.2f}x {r.get('baseline') or 'best baseline'}"
            fastest = harness.ratio_to_fastest_baseline(r, run)
            fastest_name = max((b for b in run if b.get("role") == "baseline" and harness._speed(b)),
                               key=harness._speed, default={}).get("variant")
            vs_fastest = "-" if fastest is None else f"{fastest:.2f}x {fastest_name}"
            # a row merged in from another run names its own machine and date
            device = f"{r.get('device') or header.get('device')} x{r.get('gpus') or header.get('gpus')}"
            cells = [work, r.get("variant"), r.get("role"), _fmt(r.get("ms"), "ms"), _fmt(r.get("tokens_per_s"), "tok"),
                     _fmt(r.get("mfu"), "pct"), _fmt(r.get("peak_mem_gib"), "gib"), vs, vs_fastest,
                     r.get("optimizer") or "-", str(r.get("check"))[:80], _clock(r.get("gpu_clock")), device,
                     r.get("date") or header.get("date"), sha]
            lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def _run_cells(r: dict, header: dict) -> List[str]:
    """The check, device, date and revision cells that end a row of the memory and start-up tables."""
    sha = str(r.get("git_sha") or header.get("git_sha", "unknown"))[:10]
    return [str(r.get("check"))[:80], f"{r.get('device') or header.get('device')} x{r.get('gpus') or header.get('gpus')}",
            r.get("date") or header.get("date"), sha]


def _markdown(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table (empty without rows); a ``|`` inside a cell becomes ``/``."""
    if not rows:
        return ""
    lines = ["| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |" for cells in rows]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|", *lines])


def _is_memory_row(row: dict) -> bool:
    """A row of ``bench/train_memory.py``: the trainer's memory estimate against the measured peak, no timing."""
    return "measured_gib" in row or "estimated_gib" in row


def render_memory(files: Sequence[dict]) -> str:
    """Per memory work: each layout's measured peak against the trainer's estimate at the time of the run."""
    works = latest_rows(files)
    head = ["work", "layout flags", "measured peak GiB", "estimated GiB (then)", "error", "check", "device", "date",
            "sha"]
    table = []
    for work in sorted(works):
        header, rows = works[work]
        for r in rows:
            if not _is_memory_row(r):
                continue
            error = r.get("error")
            table.append([work, r.get("layout_flags"), _fmt(r.get("measured_gib"), "gib"),
                          _fmt(r.get("estimated_gib"), "gib"), "-" if error is None else f"{100 * error:+.1f}%",
                          *_run_cells(r, header)])
    return _markdown(head, table)


def _two(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_startup(files: Sequence[dict]) -> str:
    """Per start-up work (``bench/bench_pretrained.py``): each variant's time to its first step and load, the
    medians over the run's rounds, with the ratio to the baseline row of the same run, and its peak host memory."""
    works = latest_rows(files)
    head = ["work", "variant", "role", "time to first step s", "vs baseline", "load s", "peak host GiB / rank",
            "vs baseline", "rounds", "first run on the machine s", "check", "device", "date", "sha"]
    table = []
    for work in sorted(works):
        header, rows = works[work]
        timed = [r for r in rows if r.get("time_to_first_step_s") is not None]
        base = next((r for r in timed if r.get("role") == "baseline"), None)
        for r in timed:
            def ratio(key):
                if base is None or not base.get(key) or r.get(key) is None:
                    return "-"
                return f"{r[key] / base[key]:.2f}x"

            table.append([work, r.get("variant"), r.get("role"), _two(r["time_to_first_step_s"]),
                          ratio("time_to_first_step_s"), _two(r.get("load_s")), _two(r.get("peak_host_rss_gib")),
                          ratio("peak_host_rss_gib"), r.get("rounds") or 1,
                          _two(r.get("first_run_time_to_first_step_s")), *_run_cells(r, header)])
    return _markdown(head, table)


PROFILE_ROWS = (("step ms (timed)", None), ("trace span", "span_ms"), ("GPU busy", "gpu_busy_ms"),
                ("GPU idle share", "idle_share"), ("kernel launches", "launches_per_step"))


def render_profiles(files: Sequence[dict]) -> str:
    """Per work whose newest rows carry a ``profile`` (``bench_train.py --profile``): where a step's GPU
    time goes, one column per profiled row, one line per kernel kind (ms per step). Empty without any."""
    works = latest_rows(files)
    blocks = []
    for work in work_order(works):
        if work not in works:
            continue
        header, rows = works[work]
        profiled = [r for r in rows if isinstance(r.get("profile"), dict)]
        if not profiled:
            continue
        kinds = sorted({k for r in profiled for k in r["profile"].get("by_kind_ms", {})},
                       key=lambda k: -max(r["profile"]["by_kind_ms"].get(k, 0.0) for r in profiled))
        head = [f"{work} (ms per step)"] + [str(r.get("variant")) for r in profiled]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
        for label, key in PROFILE_ROWS:
            cells = [r.get("ms") if key is None else r["profile"].get(key) for r in profiled]
            lines.append(f"| {label} | " + " | ".join(_fmt_profile(c, key) for c in cells) + " |")
        for k in kinds:
            lines.append(f"| {k} | " + " | ".join(_fmt_profile(r["profile"]["by_kind_ms"].get(k, 0.0), "ms")
                                                   for r in profiled) + " |")
        sha = str(profiled[0].get("git_sha") or header.get("git_sha", "unknown"))[:10]
        blocks.append(f"{header.get('device')}, {header.get('date')}, {sha}:\n\n" + "\n".join(lines))
    return "\n\n".join(blocks)


def _fmt_profile(value, key) -> str:
    if value is None:
        return "-"
    if key == "idle_share":
        return f"{100 * value:.1f}%"
    if key == "launches_per_step":
        return f"{value:,.0f}"
    return f"{value:.1f}"


def render_chart(files: Sequence[dict], path: Path) -> Optional[Path]:
    """A horizontal bar per row that ran: its speed against its baseline (1.0 = as fast). None without rows."""
    works = latest_rows(files)
    bars = []
    for work in work_order(works):
        if work not in works:
            continue
        header, rows = works[work]
        for r in rows:
            if _is_memory_row(r):
                continue
            ratio = harness.ratio_to_baseline(r, same_run(r, rows, header))
            if ratio is not None:
                bars.append((f"{work}: {r.get('variant')}", ratio, r.get("role"), header.get("device")))
    if not bars:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.32 * len(bars) + 1.2))
    labels = [b[0] for b in bars][::-1]
    values = [b[1] for b in bars][::-1]
    colors = ["tab:orange" if b[2] == "schedlang" else "tab:gray" for b in bars][::-1]
    ax.barh(range(len(bars)), values, color=colors)
    ax.set_yticks(range(len(bars)), labels, fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speed against the row's baseline (tokens/s or 1/time; > 1 is faster)")
    ax.set_title("schedlang (orange) and baselines (grey), from bench/results/*.json", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def section(files: Sequence[dict], chart: Optional[Path], readme_dir: Path) -> str:
    parts = [START, "",
             "Generated by `python bench/render_readme.py` from `bench/results/*.json` (GPU runs only); each row "
             "shows the device, date and git revision of the run it comes from. Commands: `bench/bench_train.py`.",
             "", render_table(files), ""]
    memory = render_memory(files)
    if memory:
        parts += ["The trainer's memory estimate (`--dry-run`'s per-rank peak) against the peak measured on rank 0 "
                  "(`bench/train_memory.py`; the estimate as the code of that run computed it, the error is "
                  "measured / estimated - 1):", "", memory, ""]
    startup = render_startup(files)
    if startup:
        parts += ["Start-up from HF safetensors (`bench/bench_pretrained.py`: from before the model is made to the "
                  "end of the first optimizer step, the slowest rank, the median of the rounds. Before the rounds each "
                  "variant runs once untimed, in the order listed, and that run's time is the 'first run' column: "
                  "the first variant to run on a fresh machine also reads from disk the libraries every variant "
                  "uses):", "", startup, ""]
    profiles = render_profiles(files)
    if profiles:
        parts += ["Where the GPU time of a step goes (`bench_train.py --profile`: 3 profiled steps, kernels grouped "
                  "by kind by `bench/profile_summary.py`; an idle share well above zero means the host is the "
                  "limit):", "", profiles, ""]
    if chart is not None:
        rel = Path(chart).resolve()
        try:
            rel = rel.relative_to(readme_dir.resolve())
        except ValueError:
            pass
        parts += [f"![speed against the baselines]({rel.as_posix()})", ""]
    parts.append(END)
    return "\n".join(parts)


def replace_section(text: str, new_section: str, where: str = "README") -> str:
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{where}: markers {START} ... {END} not found (in this order); add them where the "
                         "Performance table goes")
    return text[:start] + new_section + text[end + len(END):]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=str(harness.RESULTS_DIR), help="directory of the JSON result files")
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    parser.add_argument("--chart", default=None, help="chart PNG (default: <results>/perf.png)")
    parser.add_argument("--no-chart", action="store_true")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if the README differs")
    args = parser.parse_args(argv)
    files = load_results(Path(args.results))
    readme = Path(args.readme)
    chart = None
    if not args.no_chart and not args.check:
        chart = render_chart(files, Path(args.chart) if args.chart else Path(args.results) / "perf.png")
    elif args.check and not args.no_chart:
        png = Path(args.chart) if args.chart else Path(args.results) / "perf.png"
        chart = png if png.exists() else None
    text = readme.read_text()
    new = replace_section(text, section(files, chart, readme.parent), str(readme))
    if args.check:
        if new != text:
            print(f"{readme}: the Performance section is not what {args.results} gives; run "
                  "python bench/render_readme.py", file=sys.stderr)
            return 1
        return 0
    readme.write_text(new)
    print(f"wrote {readme} ({sum(len(f['rows']) for f in files)} rows from {len(files)} files)"
          + (f" and {chart}" if chart else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

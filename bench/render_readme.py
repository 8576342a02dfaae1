"""Render the performance figures of the README and the docs from the result files in ``bench/results/``, only.

    python bench/render_readme.py                 # rewrite README.md, docs/performance.rst and the charts
    python bench/render_readme.py --check         # exit 1 if any of them is not what the results give

Reads every ``bench/results/*.json`` written through ``bench/harness.py`` by a GPU run (files
with ``gpus`` > 0; ``--tiny`` runs on the CPU are left out). For each work the rows of its newest
file are shown; every row gives its time, tokens/s and MFU, its speed against the baseline it
names (``baseline``; else the work's fastest baseline) from the same file, the check, and the
device, date and git revision of that file. The training works of ``bench/bench_train.py`` without
a GPU result say so. Nothing is typed in by hand: to change a figure, run the benchmark again.

Three things are written, each between its markers. The README gets the headline: per training work,
its fastest schedlang row against the fastest baseline of the same run (rows whose check failed are
left out), as a short table and a chart (``docs/_static/perf_headline.png``), between
``<!-- perf-table:start -->`` and ``<!-- perf-table:end -->``. ``docs/performance.rst`` gets the same
chart, every row of every work, the memory, start-up and profile tables, and a chart of every row
against its baseline (``docs/_static/perf_all.png``), between ``.. perf-table:start`` and
``.. perf-table:end``. Each chart carries the figures it was drawn from in its PNG metadata, so
``--check`` can tell a stale chart without drawing it again (pixels differ between matplotlib releases).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/harness.py)

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
RST_START, RST_END = ".. perf-table:start", ".. perf-table:end"
DOCS_PAGE = ROOT / "docs" / "performance.rst"
STATIC = ROOT / "docs" / "_static"
HEADLINE_PNG, ALL_ROWS_PNG = "perf_headline.png", "perf_all.png"
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
        # the harness names each row's work; other results that keep rows (the planner's measured runs) are not
        # benchmark rows and have pages of their own
        rows = [r for r in data["rows"] if isinstance(r, dict) and r.get("work")]
        if not rows:
            continue
        header = {k: v for k, v in data.items() if k != "rows"}
        out.append({"path": path, "header": header, "rows": rows})
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


TABLE_HEAD = ["work", "variant", "role", "step ms", "tokens/s", "MFU", "peak GiB", "vs baseline",
              "vs fastest baseline", "optimizer", "check", "GPU clock", "device", "date", "sha"]


def table_rows(files: Sequence[dict]) -> List[List[str]]:
    """Every row of every work (the newest file of each), as the cells of :data:`TABLE_HEAD`; a training work
    without a GPU result gets one row saying so."""
    works = latest_rows(files)
    table = []
    for work in work_order(works):
        if work not in works:
            table.append([work, NO_RESULT] + [""] * (len(TABLE_HEAD) - 2))
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
            table.append([str(c) for c in (
                work, r.get("variant"), r.get("role"), _fmt(r.get("ms"), "ms"), _fmt(r.get("tokens_per_s"), "tok"),
                _fmt(r.get("mfu"), "pct"), _fmt(r.get("peak_mem_gib"), "gib"), vs, vs_fastest,
                r.get("optimizer") or "-", str(r.get("check"))[:80], _clock(r.get("gpu_clock")), device,
                r.get("date") or header.get("date"), sha)])
    return table


def render_table(files: Sequence[dict]) -> str:
    """:func:`table_rows` as a markdown table (a work without results is one short row)."""
    lines = ["| " + " | ".join(TABLE_HEAD) + " |", "|" + "|".join(" --- " for _ in TABLE_HEAD) + "|"]
    for cells in table_rows(files):
        if cells[1] == NO_RESULT:
            lines.append(f"| {cells[0]} | {NO_RESULT} |" + " |" * (len(TABLE_HEAD) - 2))
        else:
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
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


#: the start of a cell that reStructuredText would take for a list item: a bullet, or an enumerator then a space
_FLAG = re.compile(r"(--[A-Za-z][\w-]*)")
_LIST_START = re.compile(r"^([-+*#]|\(?([0-9]+|[A-Za-z])[.)])(\s|$)")


def _rst_cell(text: Any) -> str:
    """A table cell as reStructuredText that reads literally: markup characters escaped, and a start that would
    make a list (a cell ``-`` or ``+6.8%``) too."""
    text = str(text) if text not in (None, "") else "-"
    for char in "\\*_`|":
        text = text.replace(char, "\\" + char)
    # a flag (``--dp 2``) becomes a literal: Sphinx would turn its ``--`` into a dash
    text = _FLAG.sub(r"``\1``", text)
    return "\\" + text if _LIST_START.match(text) or text[0] in "-+" else text


def _rst(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A reStructuredText list-table (empty without rows)."""
    if not rows:
        return ""
    lines = [".. list-table::", "   :header-rows: 1", "   :widths: auto", ""]
    for cells in [list(head), *rows]:
        lines.append("   * - " + _rst_cell(cells[0]))
        lines.extend("     - " + _rst_cell(c) for c in cells[1:])
    return "\n".join(lines)


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str) -> str:
    return _rst(head, rows) if fmt == "rst" else _markdown(head, rows)


#: columns of :data:`TABLE_HEAD` that name the run; a work whose rows share them says them once, above its table
_RUN_COLUMNS = ("optimizer", "device", "date", "sha")
_RATIO_COLUMNS = ("vs baseline", "vs fastest baseline")
_CLOCK_HEAD = ("SM clock", "power", "power-capped", "energy")


def render_rows_by_work(files: Sequence[dict]) -> str:
    """Every row as reStructuredText, one table per work: what all its rows share (the run's device, date and
    revision, the optimizer, the baseline each ratio is against) is said once above the table, so the table
    keeps the columns that differ and reads without scrolling sideways."""
    blocks: Dict[str, List[List[str]]] = {}
    for cells in table_rows(files):
        blocks.setdefault(cells[0], []).append(cells)
    out = []
    for work, rows in blocks.items():
        if rows[0][1] == NO_RESULT:
            out += [f"**{_rst_cell(work)}**: {NO_RESULT}.", ""]
            continue
        keep = [i for i in range(1, len(TABLE_HEAD))]
        said = []
        for name in _RUN_COLUMNS:
            i = TABLE_HEAD.index(name)
            if len({r[i] for r in rows}) == 1:
                keep.remove(i)
                if name in ("device", "date", "sha"):
                    said.append(rows[0][i])
                else:
                    said.append(f"optimizer {rows[0][i]}")
        cells = [list(r) for r in rows]
        head = list(TABLE_HEAD)
        for name in _RATIO_COLUMNS:
            i = TABLE_HEAD.index(name)
            against = {r[i].split(" ", 1)[1] for r in rows if r[i] != "-"}
            if len(against) == 1:  # every ratio against the same row: name it once
                head[i] = f"{name} ({against.pop()})"
                for r in cells:
                    r[i] = r[i].split(" ", 1)[0]
        # the GPU clock in four narrow columns rather than one that wraps each row over five lines
        clock = TABLE_HEAD.index("GPU clock")
        parts = [(r[clock].split(", ") + ["-"] * 4)[:4] if r[clock] != "-" else ["-"] * 4 for r in cells]
        split_head = [h for i in keep for h in ([head[i]] if i != clock else list(_CLOCK_HEAD))]
        split_rows = [[c for i in keep for c in ([r[i]] if i != clock else p)] for r, p in zip(cells, parts)]
        out += [f"**{_rst_cell(work)}**" + (f": {_rst_cell(', '.join(said))}" if said else ""), "",
                _rst(split_head, split_rows), ""]
    return "\n".join(out).rstrip("\n")


def _is_memory_row(row: dict) -> bool:
    """A row of ``bench/train_memory.py``: the trainer's memory estimate against the measured peak, no timing."""
    return "measured_gib" in row or "estimated_gib" in row


def render_memory(files: Sequence[dict], fmt: str = "markdown") -> str:
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
    return _table(head, table, fmt)


def _two(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_startup(files: Sequence[dict], fmt: str = "markdown") -> str:
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
    return _table(head, table, fmt)


PROFILE_ROWS = (("step ms (timed)", None), ("trace span", "span_ms"), ("GPU busy", "gpu_busy_ms"),
                ("GPU idle share", "idle_share"), ("kernel launches", "launches_per_step"))


def render_profiles(files: Sequence[dict], fmt: str = "markdown") -> str:
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
        table = []
        for label, key in PROFILE_ROWS:
            cells = [r.get("ms") if key is None else r["profile"].get(key) for r in profiled]
            table.append([label] + [_fmt_profile(c, key) for c in cells])
        for k in kinds:
            table.append([k] + [_fmt_profile(r["profile"]["by_kind_ms"].get(k, 0.0), "ms") for r in profiled])
        sha = str(profiled[0].get("git_sha") or header.get("git_sha", "unknown"))[:10]
        blocks.append(f"{header.get('device')}, {header.get('date')}, {sha}:\n\n" + _table(head, table, fmt))
    return "\n\n".join(blocks)


def _fmt_profile(value, key) -> str:
    if value is None:
        return "-"
    if key == "idle_share":
        return f"{100 * value:.1f}%"
    if key == "launches_per_step":
        return f"{value:,.0f}"
    return f"{value:.1f}"


def _passed(row: dict) -> bool:
    return str(row.get("check", "")).startswith("ok")


def headline_rows(files: Sequence[dict]) -> List[dict]:
    """Per training work, its fastest schedlang row against the fastest baseline of the same run, both with a
    passing check; a work without a baseline in that run (an ablation such as the checkpointing one) has none.
    Each: work, variant, baseline (its variant), speed-up (> 1 is faster), both rows' tokens/s and the run's
    device, date and revision."""
    works = latest_rows(files)
    out = []
    for work in TRAIN_WORKS:
        if work not in works:
            continue
        header, rows = works[work]
        candidates = []
        for r in rows:
            if r.get("role") != "schedlang" or not _passed(r) or not harness._speed(r):
                continue
            baselines = [b for b in same_run(r, rows, header)
                         if b.get("role") == "baseline" and _passed(b) and harness._speed(b)]
            if baselines:
                best = max(baselines, key=harness._speed)
                candidates.append((harness._speed(r) / harness._speed(best), r, best))
        if not candidates:
            continue
        speedup, r, best = max(candidates, key=lambda c: c[0])
        out.append({"work": work, "variant": r.get("variant"), "tokens_per_s": r.get("tokens_per_s"),
                    "baseline": best.get("variant"), "baseline_tokens_per_s": best.get("tokens_per_s"),
                    "speedup": round(speedup, 4),
                    "device": f"{r.get('device') or header.get('device')} x{r.get('gpus') or header.get('gpus')}",
                    "date": r.get("date") or header.get("date"),
                    "sha": str(r.get("git_sha") or header.get("git_sha", "unknown"))[:10]})
    return out


HEADLINE_HEAD = ["work", "schedlang", "tokens/s", "strongest baseline", "tokens/s", "speed-up", "device", "date",
                 "sha"]


def render_headline(files: Sequence[dict], fmt: str = "markdown") -> str:
    table = [[h["work"], h["variant"], _fmt(h["tokens_per_s"], "tok"), h["baseline"],
              _fmt(h["baseline_tokens_per_s"], "tok"), f"{h['speedup']:.2f}x", h["device"], h["date"], h["sha"]]
             for h in headline_rows(files)]
    return _table(HEADLINE_HEAD, table, fmt)


def all_rows_bars(files: Sequence[dict]) -> List[list]:
    """One bar per row that ran: its label, its speed against its baseline, its role and device."""
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
                bars.append([f"{work}: {r.get('variant')}", round(ratio, 4), r.get("role"), header.get("device")])
    return bars


def headline_bars(files: Sequence[dict]) -> List[list]:
    return [[f"{h['work']} ({h['device']})\n{h['variant']}\nagainst {h['baseline']}", h["speedup"], "schedlang",
             h["device"]] for h in headline_rows(files)]


#: the PNG metadata keyword under which a chart keeps the figures it shows
CHART_KEY = "schedlang-bars"


def _fingerprint(bars: Sequence[list]) -> str:
    return json.dumps([list(b) for b in bars], sort_keys=True)


def draw_chart(bars: Sequence[list], path: Path, title: str) -> Optional[Path]:
    """A horizontal bar per entry: speed against a baseline (1.0 = as fast; schedlang orange, baselines grey).
    The bars' figures go into the PNG's metadata for :func:`chart_is_current`. None without bars."""
    if not bars:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines_per_label = max(str(b[0]).count("\n") + 1 for b in bars)
    longest = max(len(line) for b in bars for line in str(b[0]).split("\n"))
    # the labels' width (about 0.055 inch a character at 7 points) beside a plot of a fixed width
    fig, ax = plt.subplots(figsize=(5.5 + 0.055 * longest, (0.2 + 0.13 * lines_per_label) * len(bars) + 1.2))
    values = [b[1] for b in bars][::-1]
    ax.barh(range(len(bars)), values,
            color=["tab:orange" if b[2] == "schedlang" else "tab:gray" for b in bars][::-1])
    ax.set_yticks(range(len(bars)), [b[0] for b in bars][::-1], fontsize=7)
    for y, value in enumerate(values):
        ax.text(value, y, f" {value:.2f}x", va="center", fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8)
    if max(values) / min(values) > 50:  # micro-benchmarks span four orders of magnitude
        ax.set_xscale("log")
    else:
        ax.set_xlim(0, max(values) * 1.12)  # room for the labels right of the longest bar
    ax.set_xlabel("speed against the baseline (tokens/s or 1/time; > 1 is faster)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    # no software version in the file: the same figures drawn by another matplotlib release are just as current
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None, CHART_KEY: _fingerprint(bars)})
    plt.close(fig)
    return path


def png_text(path: Path) -> Dict[str, str]:
    """The tEXt chunks of a PNG file (keyword: text); empty for a file that is not a PNG."""
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return {}
    out, pos = {}, 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"tEXt":
            key, _, value = data[pos + 8:pos + 8 + length].partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        pos += 12 + length
    return out


def chart_is_current(bars: Sequence[list], path: Path) -> bool:
    """Whether ``path`` was drawn from exactly ``bars`` (without bars, current means no file)."""
    if not bars:
        return not path.exists()
    return path.exists() and png_text(path).get(CHART_KEY) == _fingerprint(bars)


def _relative(path: Path, start: Path) -> str:
    return Path(os.path.relpath(Path(path).resolve(), Path(start).resolve())).as_posix()


def readme_section(files: Sequence[dict], static: Path, readme_dir: Path, docs_page: Path) -> str:
    """The README's headline: the chart and, per training work, the best schedlang row against its strongest
    baseline; every row is on the docs page."""
    parts = [START, ""]
    if headline_bars(files):
        parts += [f"![schedlang against the strongest baseline of each training benchmark]"
                  f"({_relative(static / HEADLINE_PNG, readme_dir)})", ""]
    parts += ["Per training benchmark, the fastest schedlang row against the fastest baseline of the same run "
              "(both passing their check). Generated by `python bench/render_readme.py` from "
              "`bench/results/*.json` (GPU runs only); every row, the baselines and how they were measured: "
              f"[{_relative(docs_page, readme_dir)}]({_relative(docs_page, readme_dir)}).", "",
              render_headline(files) or NO_RESULT, "", END]
    return "\n".join(parts)


def docs_section(files: Sequence[dict], static: Path, docs_page: Path) -> str:
    """The docs page's generated part: the headline, every row, the memory, start-up and profile tables, and the
    chart of every row."""
    def image(name, alt):
        return [f".. image:: {_relative(static / name, docs_page.parent)}", f"   :alt: {alt}", ""]

    parts = [RST_START, "", "Generated by ``python bench/render_readme.py`` from ``bench/results/*.json`` (GPU runs "
             "only); each row shows the device, date and git revision of the run it comes from.", "",
             "Headline", "~~~~~~~~", ""]
    if headline_bars(files):
        parts += image(HEADLINE_PNG, "schedlang against the strongest baseline of each training benchmark")
    parts += ["Per training benchmark, the fastest schedlang row against the fastest baseline of the same run "
              "(both passing their check):", "", render_headline(files, "rst") or NO_RESULT, "",
              "Every row", "~~~~~~~~~", "",
              "``vs baseline`` compares a row with the baseline its work names, ``vs fastest baseline`` with the "
              "fastest baseline row of the same run, whichever it is.", "",
              render_rows_by_work(files), ""]
    if all_rows_bars(files):
        parts += image(ALL_ROWS_PNG, "every row against its baseline")
    memory = render_memory(files, "rst")
    if memory:
        parts += ["The trainer's memory estimate", "~~~~~~~~~~~~~~~~~~~~~~~~~~~~~", "",
                  "``--dry-run``'s per-rank peak against the peak measured on rank 0 (``bench/train_memory.py``; the "
                  "estimate as the code of that run computed it, the error is measured / estimated - 1):", "",
                  memory, ""]
    startup = render_startup(files, "rst")
    if startup:
        parts += ["Start-up from HF safetensors", "~~~~~~~~~~~~~~~~~~~~~~~~~~~~", "",
                  "``bench/bench_pretrained.py``: from before the model is made to the end of the first optimizer "
                  "step, the slowest rank, the median of the rounds. Before the rounds each variant runs once "
                  "untimed, in the order listed, and that run's time is the 'first run' column: the first variant "
                  "to run on a fresh machine also reads from disk the libraries every variant uses.", "", startup, ""]
    profiles = render_profiles(files, "rst")
    if profiles:
        parts += ["Where the GPU time of a step goes", "~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~", "",
                  "``bench_train.py --profile``: 3 profiled steps, kernels grouped by kind by "
                  "``bench/profile_summary.py``; an idle share well above zero means the host is the limit.", "",
                  profiles, ""]
    parts.append(RST_END)
    return "\n".join(parts)


def replace_section(text: str, new_section: str, where: str = "README", start: str = START,
                    end: str = END) -> str:
    first, last = text.find(start), text.find(end)
    if first < 0 or last < first:
        raise SystemExit(f"{where}: markers {start} ... {end} not found (in this order); add them where the "
                         "performance figures go")
    return text[:first] + new_section + text[last + len(end):]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=str(harness.RESULTS_DIR), help="directory of the JSON result files")
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    parser.add_argument("--docs-page", default=str(DOCS_PAGE), help="the docs page that shows every row")
    parser.add_argument("--static", default=str(STATIC),
                        help=f"directory of the charts ({HEADLINE_PNG}, {ALL_ROWS_PNG})")
    parser.add_argument("--no-chart", action="store_true", help="neither draw nor check the charts")
    parser.add_argument("--check", action="store_true",
                        help="only compare; exit 1 if the README, the docs page or a chart is not what the results give")
    args = parser.parse_args(argv)
    files = load_results(Path(args.results))
    readme, page, static = Path(args.readme), Path(args.docs_page), Path(args.static)
    charts = {static / HEADLINE_PNG: (headline_bars(files), "schedlang against the strongest baseline of the "
                                                             "same run, from bench/results/*.json"),
              static / ALL_ROWS_PNG: (all_rows_bars(files), "schedlang (orange) and baselines (grey) against each "
                                                            "row's baseline, from bench/results/*.json")}
    targets = {readme: replace_section(readme.read_text(), readme_section(files, static, readme.parent, page),
                                       str(readme)),
               page: replace_section(page.read_text(), docs_section(files, static, page), str(page), RST_START,
                                     RST_END)}
    if args.check:
        stale = [str(path) for path, text in targets.items() if path.read_text() != text]
        if not args.no_chart:
            stale += [str(path) for path, (bars, _) in charts.items() if not chart_is_current(bars, path)]
        if stale:
            print(f"not what {args.results} gives: {', '.join(stale)}; run python bench/render_readme.py",
                  file=sys.stderr)
            return 1
        return 0
    for path, text in targets.items():
        path.write_text(text)
    drawn = []
    if not args.no_chart:
        for path, (bars, title) in charts.items():
            if draw_chart(bars, path, title) is not None:
                drawn.append(str(path))
            elif path.exists():
                path.unlink()  # no rows any more: a chart left behind would show figures that are gone
    print(f"wrote {readme} and {page} ({sum(len(f['rows']) for f in files)} rows from {len(files)} files)"
          + (f" and {', '.join(drawn)}" if drawn else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

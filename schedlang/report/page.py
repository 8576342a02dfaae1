"""One self-contained HTML page from :class:`~schedlang.report.collect.ReportData`: inline CSS and
SVG, no script and nothing fetched, so it reads the same offline and attached to a bug report."""

from __future__ import annotations

import html
from typing import Any, Dict, List

from .collect import ReportData
from .graph_svg import graph_svg

__all__ = ["render"]

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #111827; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #e5e7eb; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: .9em; } td, th { border: 1px solid #e5e7eb; padding: .25em .6em; }
th { background: #f9fafb; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f9fafb; border: 1px solid #e5e7eb; padding: .8em; overflow: auto; font-size: .85em; }
.pass { color: #166534; font-weight: bold; } .fail { color: #991b1b; font-weight: bold; }
.note { color: #6b7280; } .changed { background: #fffbeb; } .graphs { display: flex; gap: 1.5em; overflow: auto; }
.graphs > div { flex: 0 0 auto; } code { font-size: .9em; } nav a { margin-right: 1em; }
"""

SECTIONS = [("plan", "Plan"), ("tree", "Module tree"), ("graphs", "Traced graphs"), ("kernels", "Fused kernels"),
            ("ranks", "Parameters and memory per rank"), ("training", "Training plan"), ("verify", "Verification")]


def _e(value: Any) -> str:
    return html.escape(str(value))


def _table(headers: List[str], rows: List[List[str]], numeric=()) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(row))
        body.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _plan(data: ReportData) -> str:
    if not data.plan:
        return '<p class="note">The plan is empty.</p>'
    return _table(["#", "primitive", "path", "arguments"],
                  [[str(s["index"]), f"<code>{_e(s['primitive'])}</code>", f"<code>{_e(s['path'])}</code>",
                    f"<code>{_e(s['args'])}</code>"] for s in data.plan], numeric=(0,))


def _tree(data: ReportData) -> str:
    rows = []
    for r in data.tree:
        indent = "&nbsp;" * 3 * r["depth"]
        kind = _e(r["type"]) if r["type"] == r["type_before"] else f"{_e(r['type_before'])} → <b>{_e(r['type'])}</b>"
        steps = ", ".join(f"[{i}]" for i in r["steps"])
        rows.append([f"{indent}<code>{_e(r['path'])}</code>", kind, f"{r['params']:,}", _e(steps),
                     _e("; ".join(r["notes"]))])
    return _table(["module", "type", "parameters (this rank)", "steps", "what the schedule did"], rows,
                  numeric=(2,))


def _graphs(data: ReportData) -> str:
    if not data.graphs:
        return '<p class="note">No submodule was traced.</p>'
    parts = []
    for g in data.graphs:
        before = (graph_svg(g["before"], f"{g['path']} as traced") if g["before"] is not None
                  else '<p class="note">(not recorded)</p>')
        after = graph_svg(g["after"], f"{g['path']} now")
        parts.append(f"<h3><code>{_e(g['path'])}</code></h3><div class=\"graphs\">"
                     f"<div><h4>as traced</h4>{before}</div><div><h4>after the schedule</h4>{after}</div></div>"
                     f"<details><summary>code</summary><pre>{_e(g['code'])}</pre></details>")
    return "".join(parts)


def _kernels(data: ReportData) -> str:
    if not data.kernels:
        return '<p class="note">No subgraph was fused.</p>'
    parts = []
    for k in data.kernels:
        where = f" — generated into <code>{_e(k['file'])}</code>" if k.get("file") else ""
        parts.append(f"<h3><code>{_e(k['name'])}</code> at <code>{_e(k['path'])}</code> ({_e(k['compiler'])})</h3>"
                     f"<p>inputs ({_e(', '.join(k['inputs']))}) → outputs ({_e(', '.join(k['outputs']))}){where}</p>"
                     f"<pre>{_e(k['source'])}</pre>")
    return "".join(parts)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _ranks(data: ReportData) -> str:
    has_peak = any("peak_memory_bytes" in r for r in data.ranks)
    headers = ["rank", "parameters", "parameter MiB", "buffer MiB"] + (["peak GPU MiB"] if has_peak else [])
    rows = []
    for r in data.ranks:
        row = [str(r["rank"]), f"{r['parameters']:,}", _mib(r["parameter_bytes"]), _mib(r["buffers"])]
        if has_peak:
            row.append(_mib(r.get("peak_memory_bytes", 0)))
        rows.append(row)
    return _table(headers, rows, numeric=tuple(range(len(headers))))


def _training(data: ReportData) -> str:
    if data.training is None:
        return ('<p class="note">No training estimate: the model is no decoder-only transformer (a HF config and a '
                "list of decoder layers).</p>")
    return ('<p class="note">What one training step of this schedule costs per rank, estimated by the autotune cost '
            "model before anything runs (the block <code>schedlang train --dry-run</code> prints).</p>"
            f"<pre>{_e(data.training['text'])}</pre>")


def _verify(data: ReportData) -> str:
    v = data.verify
    if v is None:
        return '<p class="note">Not verified here: wrap the schedule in <code>schedlang.Verify</code> to compare it.</p>'
    head = '<p class="pass">Verify passed.</p>' if v["passed"] else '<p class="fail">Verify FAILED.</p>'
    table = ""
    if v["rows"]:
        keys = list(v["rows"][0].keys())
        table = _table(keys, [[_e(r.get(k, "")) for k in keys] for r in v["rows"]])
    return head + table + f"<pre>{_e(v['text'])}</pre>"


def render(data: ReportData) -> str:
    """The page as a string."""
    bodies: Dict[str, str] = {"plan": _plan(data), "tree": _tree(data), "graphs": _graphs(data),
                              "kernels": _kernels(data), "ranks": _ranks(data), "training": _training(data),
                              "verify": _verify(data)}
    nav = "".join(f'<a href="#{key}">{_e(title)}</a>' for key, title in SECTIONS)
    sections = "".join(f'<section id="{key}"><h2>{_e(title)}</h2>{bodies[key]}</section>' for key, title in SECTIONS)
    versions = ", ".join(f"{k} {v}" for k, v in data.versions.items())
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(data.title)}</title>'
            f"<style>{_CSS}</style></head><body><h1>{_e(data.title)}</h1>"
            f'<p class="note">{_e(data.model_class)}, {data.world_size} rank(s); {_e(versions)}</p>'
            f"<nav>{nav}</nav>{sections}</body></html>")

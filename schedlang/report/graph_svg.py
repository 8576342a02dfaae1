"""FX graphs drawn as SVG, with no layout engine: nodes in layers by their longest path from an
input, edges as curves. Good for the small graphs a schedule traces (a block, an MLP).

:func:`describe_graph` turns a graph into plain data (names, kinds, labels, inputs), so a graph
can be kept in a schedule's metadata (the graph as first traced) and drawn later, after the
graph itself has been rewritten.

Example::

    svg = graph_svg(describe_graph(trace_module(mlp).graph), title="mlp")
"""

from __future__ import annotations

import html
from typing import Dict, List, Sequence

import torch.fx as fx

__all__ = ["describe_graph", "graph_svg", "MAX_DRAWN_NODES"]

#: larger graphs are listed as code instead: a drawing of thousands of nodes reads as noise
MAX_DRAWN_NODES = 400

_NODE_W, _NODE_H, _GAP_X, _GAP_Y, _MARGIN = 150, 26, 18, 34, 12
_COLORS = {"placeholder": "#dbeafe", "output": "#dcfce7", "call_module": "#fef3c7", "call_function": "#f3f4f6",
           "call_method": "#f3f4f6", "get_attr": "#ede9fe", "fused": "#fecaca"}


def _label(graph_owner, node: fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return node.name if node.op == "placeholder" else "output"
    if node.op == "call_module":
        return str(node.target)
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "get_attr":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def describe_graph(graph: fx.Graph, owner=None) -> List[Dict]:
    """Plain-data nodes of ``graph``: ``{"name", "op", "label", "inputs", "fused"}`` in graph order.

    ``owner`` (the module holding the graph) marks calls of fused kernels.
    """
    from ..lowering.fused_module import FusedSubgraph

    nodes = []
    for node in graph.nodes:
        fused = False
        if owner is not None and node.op == "call_module":
            try:
                fused = isinstance(owner.get_submodule(str(node.target)), FusedSubgraph)
            except AttributeError:
                fused = False
        nodes.append({"name": node.name, "op": node.op, "label": _label(owner, node),
                      "inputs": [n.name for n in node.all_input_nodes], "fused": fused})
    return nodes


def _layers(nodes: Sequence[Dict]) -> Dict[str, int]:
    depth: Dict[str, int] = {}
    for node in nodes:  # graph order is topological
        depth[node["name"]] = 1 + max((depth[i] for i in node["inputs"] if i in depth), default=-1)
    return depth


def graph_svg(nodes: Sequence[Dict], title: str = "") -> str:
    """An ``<svg>`` element drawing the described graph (see :func:`describe_graph`)."""
    if len(nodes) > MAX_DRAWN_NODES:
        return (f'<p class="note">{html.escape(title)}: {len(nodes)} nodes, more than the {MAX_DRAWN_NODES} '
                "drawn; see the code below.</p>")
    depth = _layers(nodes)
    rows: Dict[int, List[Dict]] = {}
    for node in nodes:
        rows.setdefault(depth[node["name"]], []).append(node)
    width = max((len(r) for r in rows.values()), default=1)
    pos = {}
    for level, row in rows.items():
        offset = (width - len(row)) * (_NODE_W + _GAP_X) / 2
        for k, node in enumerate(row):
            x = _MARGIN + offset + k * (_NODE_W + _GAP_X)
            y = _MARGIN + level * (_NODE_H + _GAP_Y)
            pos[node["name"]] = (x, y)
    total_w = 2 * _MARGIN + width * (_NODE_W + _GAP_X)
    total_h = 2 * _MARGIN + (max(rows, default=0) + 1) * (_NODE_H + _GAP_Y)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="graph" width="{total_w:.0f}" height="{total_h:.0f}" '
             f'viewBox="0 0 {total_w:.0f} {total_h:.0f}" role="img" aria-label="{html.escape(title)}">']
    for node in nodes:
        x2, y2 = pos[node["name"]]
        for src in node["inputs"]:
            if src not in pos:
                continue
            x1, y1 = pos[src]
            sx, sy, ex, ey = x1 + _NODE_W / 2, y1 + _NODE_H, x2 + _NODE_W / 2, y2
            mid = (sy + ey) / 2
            parts.append(f'<path d="M{sx:.0f},{sy:.0f} C{sx:.0f},{mid:.0f} {ex:.0f},{mid:.0f} {ex:.0f},{ey:.0f}" '
                         'fill="none" stroke="#9ca3af" stroke-width="1.2"/>')
    for node in nodes:
        x, y = pos[node["name"]]
        color = _COLORS["fused"] if node["fused"] else _COLORS.get(node["op"], "#f3f4f6")
        label = node["label"] if len(node["label"]) <= 22 else node["label"][:20] + "…"
        parts.append(f'<g><title>{html.escape(node["name"])} ({node["op"]}): {html.escape(node["label"])}</title>'
                     f'<rect x="{x:.0f}" y="{y:.0f}" width="{_NODE_W}" height="{_NODE_H}" rx="5" fill="{color}" '
                     'stroke="#6b7280"/>'
                     f'<text x="{x + _NODE_W / 2:.0f}" y="{y + 17:.0f}" text-anchor="middle" '
                     f'font-size="11" font-family="monospace">{html.escape(label)}</text></g>')
    parts.append("</svg>")
    return "".join(parts)

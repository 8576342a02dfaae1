"""A visual report of what a schedule did: one self-contained HTML page.

The page holds the plan, the module tree with what each step did to each module, the graphs of
traced submodules as first traced and after the schedule (drawn), the generated source of every
fused kernel, a per-rank parameter and memory table, and Verify's comparison.

Example::

    with schedlang.Verify(sch, example_inputs=[ids]) as check:
        shard_model(sch)
    sch.report("report.html", verify=check.report)

or ``schedlang report --out report.html`` for the demo's schedule.
"""

from __future__ import annotations

import os
from typing import Optional

from .collect import ReportData, collect
from .graph_svg import describe_graph, graph_svg
from .page import SECTIONS, render

__all__ = ["write_report", "collect", "render", "ReportData", "describe_graph", "graph_svg", "SECTIONS"]


def write_report(sch, path: str, model=None, verify=None, title: str = "", training=None) -> Optional[str]:
    """Write the report of ``sch`` to ``path``; returns the path on the rank that wrote it.

    ``verify`` is a :class:`~schedlang.Verify` (or its ``report``) to show; ``model`` the built
    model, for its per-rank parameters and memory; ``training`` the ``global_batch`` and ``seq`` of the
    training plan shown for a decoder-only transformer. Under ``torch.distributed`` every rank calls
    it and rank 0 writes the file.
    """
    from ..distributed import groups

    report = getattr(verify, "report", verify)
    data = collect(sch, model=model, verify_report=report, title=title, training=training)
    if groups.is_distributed() and groups.rank(None) != 0:
        return None
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(data))
    return path

"""Horizontal fusion by atomic rules, applied until nothing changes.

Each rule (one file each in this folder) does one small rewrite step:

==================  ============================================================================
rule                rewrite
==================  ============================================================================
linear_same_input   linears sharing an input -> one GEMM on concatenated weights + split
linear_batched      same-shape linears on different inputs -> one ``baddbmm`` on stacked weights
layer_norm          layer norms over pieces of a split / same-shape inputs -> one group layer norm
activation          tanh / relu / sigmoid / gelu / silu over such groups -> one op
split_cat           ``cat`` of all pieces of a split, in order -> the split's input
stack_unbind        ``stack`` of unbind pieces (or equal split pieces) -> a view; and the reverse
cat_unbind          ``cat`` of unbind pieces -> ``flatten`` of the grouped tensor
embedding_bags      embedding bags over the pieces of a sparse-feature split -> one lookup
==================  ============================================================================

Chained, they turn the seed post's ``split -> N x LayerNorm -> N x tanh -> cat`` into
``unflatten -> group_layer_norm -> tanh -> flatten``, and N parallel
``Linear -> LayerNorm -> ReLU`` branches into one of each.

Shapes: the rules use the shapes a graph carries (``ShapeProp``, fake-tensor values) or
that ``example_inputs`` give; without them they reason from structure. Where only the
length of a tensor can tell whether a group is uniform (the last piece of
``x.split(D, 1)`` may be shorter), the fused op checks it at run time and falls back to the
exact per-piece computation (``group_ops.piecewise_layer_norm`` for layer norms,
``group_ops.piecewise_batched_linear`` for linears on the pieces, e.g. the rows of
``x.split(B, 0)``, and ``span_of_pieces``), so every branch of the seed chain is fused
either way.

Fusion rules group candidates in two steps: by a rule key (same input and in_features;
same shapes and dtype ...), then into sets without data dependencies between members
(ancestor bitsets, see ``_grouping.py``). Work is done on a copy of the graph and
installed at the end, so an error leaves the module unchanged.

Example::

    gm = torch.fx.symbolic_trace(model)
    report = horizontal_fuse(gm)
    print(report)          # which rule fused which nodes into what
    print(gm.code)
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import fx

from ...errors import ScheduleTypeError, ScheduleValueError
from ._context import (
    FUSED_SOURCES,
    FusedParameter,
    FusionRecord,
    ParamSource,
    RewriteContext,
    Rule,
    SimplifyRule,
)
from ._grouping import Reachability, SweepGuard, independent_sets
from ._shapes import check_example_inputs, forget_example_values, note_example_values
from .activation import ActivationGroup
from .cat_unbind import CatUnbind
from .embedding_bags import EmbeddingBagGroup
from .layer_norm import LayerNormGroup
from .linear_batched import LinearBatched
from .linear_same_input import LinearSameInput
from .split_cat import SplitCat
from .stack_unbind import StackUnbind

__all__ = ["RULES", "horizontal_fuse", "HorizontalFusionReport", "resolve_rules", "fused_parameter_sources",
           "fused_sources"]

logger = logging.getLogger("schedlang.graph.passes.horizontal")

#: every rule by name, in the order a sweep applies them
RULES: Dict[str, Rule] = {rule.name: rule for rule in (
    LinearSameInput(), LinearBatched(), LayerNormGroup(), ActivationGroup(), SplitCat(), StackUnbind(), CatUnbind(),
    EmbeddingBagGroup())}


@dataclass
class HorizontalFusionReport:
    """What :func:`horizontal_fuse` did: every rewrite, counts per rule, new parameters."""

    path: str
    rules: List[str]
    records: List[FusionRecord] = field(default_factory=list)
    sweeps: int = 0
    nodes_before: int = 0
    nodes_after: int = 0
    parameters: Dict[str, FusedParameter] = field(default_factory=dict)

    @property
    def counts(self) -> Dict[str, int]:
        """Rewrites per rule (rules that did nothing are left out)."""
        return dict(Counter(r.rule for r in self.records))

    def __len__(self) -> int:
        return len(self.records)

    def __str__(self) -> str:
        where = self.path or "<root>"
        lines = [f"horizontal_fuse at '{where}': {len(self.records)} rewrite(s) in {self.sweeps} sweep(s), "
                 f"graph {self.nodes_before} -> {self.nodes_after} nodes"]
        if not self.records:
            lines.append(f"  nothing to fuse (rules: {', '.join(self.rules)})")
        for rule, n in self.counts.items():
            lines.append(f"  {rule:<18} x{n}")
        if self.records:
            lines.append("rewrites:")
        for r in self.records:
            lines.append(f"  [{r.rule}] {_names(r.members)} -> {r.result}: {r.detail}")
        if self.parameters:
            lines.append("new parameters:")
        for p in self.parameters.values():
            src = _names(tuple(s.name for s in p.sources))
            lines.append(f"  {p.name} {tuple(p.shape)} <- {src}")
        return "\n".join(lines)


def _names(names: Sequence[str], limit: int = 4) -> str:
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit - 1])}, ..., {names[-1]} ({len(names)})"


def resolve_rules(rules: Optional[Sequence[str]], where: str = "<root>") -> List[str]:
    """Rule names to apply, in sweep order; raise a clear error (at path ``where``) for unknown ones."""
    if rules is None:
        return list(RULES)
    if isinstance(rules, str) or not isinstance(rules, (list, tuple)):
        raise ScheduleTypeError(f"{where}: horizontal_fuse rules must be None or a list of rule names, got {rules!r}; "
                                f"valid rules are {', '.join(RULES)}")
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        raise ScheduleValueError(f"{where}: unknown horizontal fusion rule {unknown[0]!r}: valid rules are "
                                 f"{', '.join(RULES)}")
    return [name for name in RULES if name in rules]


def horizontal_fuse(gm: fx.GraphModule, rules: Optional[Sequence[str]] = None, min_group_size: int = 2,
                    path: str = "", max_sweeps: int = 100,
                    example_inputs: Optional[Sequence[torch.Tensor]] = None) -> HorizontalFusionReport:
    """Apply the atomic horizontal rules to ``gm`` in place until nothing changes.

    ``rules``: None (all) or names from :data:`RULES`. Groups smaller than
    ``min_group_size`` are left alone. New parameters (concatenated/stacked weights) are
    registered on ``gm`` and listed in ``gm._schedlang_fused_params`` (see
    :func:`fused_parameter_sources`); the originals they replace are removed.

    ``example_inputs``: tensors shaped like ``gm``'s inputs (only shape and dtype count). The
    graph then runs once on fake tensors, so that the rules know every node's shape, as they
    do on a graph that carries shape metadata already (``ShapeProp``). Without shapes, the
    rules still fuse what structure proves; where an int split's last piece may be shorter,
    the fused op checks the length at run time (see :mod:`~schedlang.graph.passes.group_ops`).

    Example::

        gm = torch.fx.symbolic_trace(model)
        print(horizontal_fuse(gm, rules=["layer_norm", "activation", "stack_unbind", "cat_unbind"]))
    """
    where = path or "<root>"
    names = resolve_rules(rules, where)
    if type(min_group_size) is not int or min_group_size < 2:
        raise ScheduleValueError(f"{where}: min_group_size must be an int >= 2, got {min_group_size!r}")
    if example_inputs is not None:
        example_inputs = check_example_inputs(gm, example_inputs, where)
    ctx = RewriteContext(gm, min_group_size)
    if example_inputs is not None:
        note_example_values(gm, ctx.graph, example_inputs, where)
    report = HorizontalFusionReport(path=path, rules=names, nodes_before=len(ctx.graph.nodes))
    progress = _progress(len(ctx.graph.nodes))
    while report.sweeps < max_sweeps:
        report.sweeps += 1
        changed = 0
        for name in names:
            changed += _apply(ctx, RULES[name])
        if progress is not None:
            progress.update(1)
            progress.set_postfix(rewrites=len(ctx.records), nodes=len(ctx.graph.nodes))
        if not changed:
            break
    else:
        logger.warning("horizontal_fuse at '%s': stopped after %d sweeps with rules still applying",
                       path or "<root>", max_sweeps)
    if progress is not None:
        progress.close()
    forget_example_values(ctx.graph)  # shapes may change in later steps: no stale notes in the installed graph
    ctx.commit()
    report.records = list(ctx.records)
    report.nodes_after = len(gm.graph.nodes)
    registry = getattr(gm, "_schedlang_fused_params", {})
    report.parameters = {k: registry[k] for k in ctx.fused_parameters if k in registry}
    logger.info("%s", report)
    return report


def _apply(ctx: RewriteContext, rule: Rule) -> int:
    """One sweep of one rule over the whole graph; returns the number of rewrites."""
    done = 0
    if isinstance(rule, SimplifyRule):
        for match in rule.matches(ctx):
            if getattr(match, "_erased", False):
                continue
            if rule.rewrite(ctx, None, match):
                done += 1
        if done:
            ctx.restore_topological_order()
        return done
    ctx.refresh_references()
    groups = [(k, m) for k, m in rule.collect(ctx).items() if len(m) >= ctx.min_group_size]
    if not groups:
        return 0
    reach = Reachability(ctx.graph) if rule.needs_independence else None
    guard = SweepGuard(reach) if reach is not None else None
    for key, members in groups:
        sets = independent_sets(members, reach) if reach is not None else [members]
        for group in sets:
            if len(group) < ctx.min_group_size:
                continue
            if guard is not None and not guard.allows(group):
                continue  # another fusion of this sweep could make it cyclic: next sweep decides
            if rule.rewrite(ctx, key, group):
                done += 1
                if guard is not None:
                    guard.record(group)
    if done:
        ctx.restore_topological_order()
    return done


def _progress(n_nodes: int):
    if n_nodes < 2000 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(desc="horizontal_fuse sweeps", unit="sweep", leave=False)


def fused_parameter_sources(gm: fx.GraphModule) -> Dict[str, FusedParameter]:
    """New parameters made by horizontal fusion on ``gm`` and where each original lives in them.

    Example (mapping a gradient back to an original parameter)::

        for name, info in fused_parameter_sources(gm).items():
            grad = getattr(gm, name).grad
            for src in info.sources:
                print(src.name, src.take(grad).shape)
    """
    return dict(getattr(gm, "_schedlang_fused_params", {}))


def fused_sources(param: torch.Tensor) -> List[Tuple[torch.Tensor, ParamSource]]:
    """``[(original_parameter, source)]`` if ``param`` was made by fusing parameters still alive, else [].

    ``source.take(param.grad)`` is the part of the gradient that belongs to the original.

    Example::

        for original, src in fused_sources(gm.hfused_ln_weight_0):
            torch.testing.assert_close(src.take(gm.hfused_ln_weight_0.detach()), original.detach())
    """
    info = FUSED_SOURCES.get(param)
    if info is None:
        return []
    out = []
    for s in info.sources:
        original = s.source() if s.source is not None else None
        if original is not None:
            out.append((original, s))
    return out

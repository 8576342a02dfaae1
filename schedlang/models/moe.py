"""Mixture-of-experts blocks in the automatic tensor-parallel plan: every expert split like a dense MLP.

transformers 5.x keeps a block's experts as 3-D tensors in one module (see
:mod:`schedlang.distributed.shard_rules.experts`). :func:`find_experts` finds them in a layer and
:func:`apply_experts` writes, for each:

* the shards: ``gate_up_proj`` along the intermediate width in two blocks (rank r keeps [gate_r, up_r]
  of every expert), its bias likewise, ``down_proj`` along the same width;
* a ``fwd_post`` all-reduce of the experts' output (each rank computed a partial sum of every
  expert's output, weighted by the routing weights);
* a ``bwd_post`` all-reduce of their inputs' gradients: the tokens' (the sync primitive) and the routing
  weights' (the rule's :class:`~schedlang.distributed.shard_rules.experts.InputGradientSync`), so the
  router and everything before the experts get whole gradients and need nothing else.

The router, a shared expert's gate and anything else in the block are untouched: a shared expert with
its own projections is split by the plan as any MLP. Experts whose layout cannot be split (gate and up
interleaved, a bias added per expert before the sum, a norm after each expert) stay whole on every rank,
which is correct, and the plan says why.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from torch import nn

from ..distributed.shard_rules.experts import ExpertsLayout, experts_layout, is_experts

__all__ = ["ExpertsPlan", "find_experts", "apply_experts"]


@dataclasses.dataclass
class ExpertsPlan:
    """The experts module at ``path``: split along ``tensors`` (``(name, axis)``), or kept whole (``whole``: why)."""

    path: str
    tensors: List[Tuple[str, int]] = dataclasses.field(default_factory=list)
    whole: Optional[str] = None

    def describe(self, prefix: str = "") -> str:
        where = self.path[len(prefix):] if prefix and self.path.startswith(prefix) else self.path
        if self.whole:
            return f"{where} (experts): kept whole: {self.whole}"
        return f"{where} (experts): {', '.join(n for n, _ in self.tensors)} split along the intermediate width, output " \
               f"all-reduced"


def find_experts(layer_path: str, layer: nn.Module) -> List[ExpertsPlan]:
    """The experts modules of ``layer`` (at ``layer_path``), each with where it is split or why it stays whole."""
    found = []
    for sub_path, module in layer.named_modules():
        if not is_experts(module):
            continue
        path = f"{layer_path}.{sub_path}" if sub_path else layer_path
        why = experts_layout(module)
        if why is not None:
            found.append(ExpertsPlan(path, whole=why))
            continue
        layout = ExpertsLayout(module)
        found.append(ExpertsPlan(path, tensors=[(name, axis) for name, (axis, _) in layout.axes.items()]))
    return found


def apply_experts(root, plan: ExpertsPlan) -> None:
    """Write the steps of one :class:`ExpertsPlan` into the schedule ``root`` (nothing for experts kept whole)."""
    if plan.whole:
        return
    experts = root[plan.path]
    for name, axis in plan.tensors:
        experts.shard(name, axis=axis)
    experts.sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    experts.sync(mode="bwd_post", sync_op_or_fn="all_reduce")

"""What the automatic tensor-parallel plan checks before it writes a step.

Splitting a block's heads is only right when everything between its column and its row
projections works head by head. :func:`block_findings` reads a block's structure (its modules
with weights and the parameters of the attention module itself) and says

* which parameters of the attention module hold one entry per head (gpt-oss's attention sinks, a
  per-head gate bias): they are split with the heads (``BlockPlan.head_params``);
* which modules with weights see only this rank's heads but work per head (Qwen3's ``q_norm`` over
  ``head_dim``): their weight gradients are summed over the ranks (``BlockPlan.summed``);
* which modules normalize (or otherwise mix) the *whole* width of a split projection (OLMo-2's
  ``q_norm`` over all heads of ``q_proj``, BitNet's ``attn_sub_norm`` before ``o_proj``): split,
  each rank would see only its part of what they reduce over. The block is marked unsupported
  (``BlockPlan.unsupported``) and :func:`~schedlang.models.auto.apply_tensor_parallel` refuses it
  before writing any step, with :class:`UnsupportedModelError`.

A refusal names the module and the reason, and what to write by hand: keep the block whole by
dropping it from the plan (the other blocks are still split), or register a schedule of the family's own.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from torch import nn

from ..distributed.shard_rules.forward_code import is_conv1d
from ..errors import UnsupportedModelError

__all__ = ["UnsupportedModelError", "BlockFindings", "block_findings", "refusal_parts", "probe_parts",
           "KEEP_WHOLE_RECIPE"]

#: the recipe a refusal gives to keep the refused blocks whole and split the rest
KEEP_WHOLE_RECIPE = ("plan = plan_tensor_parallel(sch); plan.all_blocks = [b for b in plan.all_blocks if not "
                     "b.unsupported]; apply_tensor_parallel(sch, plan)")


@dataclasses.dataclass
class BlockFindings:
    summed: List[str]
    head_params: List[Tuple[str, int]]
    unsupported: Optional[str]


def _out_width(module: nn.Module) -> int:
    weight = module.weight
    return int(weight.shape[1] if is_conv1d(module) else weight.shape[0])


def _heads(module: nn.Module):
    from ..distributed.shard_rules.generic_block import heads_of

    try:
        return heads_of(module)
    except Exception:  # a config whose attributes cannot be read globally (per-layer values): no geometry
        return None


def head_parameters(module: nn.Module) -> List[Tuple[str, int]]:
    """``(name, axis)`` of the attention module's own parameters with one entry (or one head's worth of
    entries) per query head along ``axis``."""
    heads = _heads(module)
    if heads is None:
        return []
    found = []
    for name, p in module.named_parameters(recurse=False):
        for axis, size in enumerate(p.shape):
            if size in (heads.q, heads.q * heads.dim) and size > 1:
                found.append((name, axis))
                break
    return found


def block_findings(module: nn.Module, path: str, kind: str, columns: Sequence[str], row: str,
                   weighted: Sequence[str], region: Dict[str, FrozenSet[str]]) -> BlockFindings:
    """What the plan must do about a block's other modules and parameters (see the module docstring).

    ``weighted``: the block's children with weights that are no projections; ``region``: for each, the
    projections its input is computed from."""
    widths = {c: _out_width(module.get_submodule(c)) for c in columns}
    summed, unsupported = [], None
    for name in weighted:
        sources = region.get(name, frozenset())
        split_by = sorted(c for c in columns if c in sources)
        if not split_by or row in sources:
            continue  # outside the split region (it sees whole activations)
        child = module.get_submodule(name)
        for sub_path, sub in child.named_modules():
            params = list(sub.parameters(recurse=False))
            if not params:
                continue
            wide = [c for c in split_by for p in params if widths[c] in tuple(p.shape) and widths[c] > 1]
            where = f"{path}.{name}" + (f".{sub_path}" if sub_path else "")
            if wide and unsupported is None:
                unsupported = (f"{where} ({type(sub).__name__}) has weights over the whole output of {wide[0]} "
                               f"({widths[wide[0]]} features, every head) and works on it whole: with the heads split "
                               f"over the ranks it would see only this rank's part (a norm's statistics would cover "
                               f"only its heads)")
            summed.append(f"{name}.{sub_path}" if sub_path else name)
    head_params = head_parameters(module) if kind == "attention" else []
    return BlockFindings(summed=summed, head_params=head_params, unsupported=unsupported)


def refusal_parts(reasons: List[Tuple[str, str]]) -> Tuple[str, str]:
    """``(where, what)`` of an :class:`UnsupportedModelError` for blocks ``[(path, reason)]`` (the first few named)."""
    shown = "; ".join(reason for _, reason in reasons[:2])
    more = f" (and {len(reasons) - 2} more blocks alike)" if len(reasons) > 2 else ""
    return reasons[0][0], shown + more


def probe_parts(plan, failure) -> Tuple[str, str]:
    """``(where, kind)`` of an :class:`UnsupportedModelError` for a plan whose model fails the shape probe
    (:mod:`schedlang.models.shape_probe`): the module, and the kind of the block around it (to keep whole)."""
    where = failure.path or "<root>"
    block = max((b for b in plan.all_blocks if where == b.path or where.startswith(b.path + ".")),
                key=lambda b: len(b.path), default=None)
    return where, block.kind if block is not None else "attention"

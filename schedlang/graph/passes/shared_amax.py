"""Rule ``shared_amax``: a whole-tensor ``max`` (or ``max(abs(.))``) of one tensor is computed once.

Dynamic float8 scaling (torchao's ``tensorwise`` recipe) computes ``amax = max(abs(x))`` of every
matmul operand. In the joint forward + backward graph that Inductor partitions, the same activation
gets that reduction more than once, each time through a different view: the forward casts ``x`` for
the output GEMM, and the backward recomputes the scale of ``x.reshape(-1, d)`` for the weight-gradient
GEMM. AOTAutograd's common-subexpression pass matches nodes structurally, so ``max(abs(view(x)))``
and ``max(abs(x))`` stay two full passes over the tensor (for a LLaMA-1.1B layer about 190 MB of
extra reads per step). A whole-tensor maximum does not depend on the view it is taken through, so
this rule keeps the first such reduction of each tensor and points the others at it; the
partitioner then saves the scalar for the backward instead of re-reading the activation.

Before::

    a1 = max(abs(x));  ...;  a2 = max(abs(view(x, [-1, d])))      # two reads of x

After::

    a1 = max(abs(x));  ...;  (uses of a2 read a1)                  # one read of x

Exact: the maximum of the same elements of the same graph node. (Under Inductor one difference can
show: where the partitioner recomputes an activation in the backward, Inductor computes the fused
bf16 chain in fp32, and without this rule the backward took the scale of that recomputed copy; with
it, the backward uses the forward's scale, as eager mode does.) What counts as "the same tensor" is
strict: only views, transposes, permutes, expands, squeezes and dtype-preserving copies
(``clone``, ``contiguous``) lie between the reduction and the shared tensor; a cast to another dtype,
a slice or any arithmetic keeps the reductions apart. Reductions with a ``dim`` stay apart too
(``rowwise`` scales depend on the layout).

Used by :func:`schedlang.models.compile_layers` through Inductor's ``joint_custom_post_pass`` (see
:class:`SharedAmaxPass`); :func:`share_amax` works on any functional aten-level FX graph.
"""

from __future__ import annotations

import logging
from typing import Dict, Hashable, List, Optional, Tuple

import torch
from torch import fx

from ._inductor_pass import InductorPass

__all__ = ["share_amax", "SharedAmaxPass", "whole_tensor_max_source"]

logger = logging.getLogger("schedlang.graph.passes.shared_amax")

aten = torch.ops.aten

#: ops whose output holds exactly the elements of their first argument (each at least once), same dtype
_SAME_ELEMENTS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
    aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default,
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default,
    aten.clone.default, aten.contiguous.default, aten.flatten.using_ints,
}


def _value(node: fx.Node) -> Optional[torch.Tensor]:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def _is_dtype_preserving_copy(node: fx.Node) -> bool:
    # a layout/memory-format copy: _to_copy with no dtype change (and no device change)
    if node.target is not aten._to_copy.default or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    before, after = _value(node.args[0]), _value(node)
    return before is not None and after is not None and before.dtype == after.dtype and before.device == after.device


def _keeps_elements(node: fx.Node) -> bool:
    """Whether ``node``'s output holds exactly its first argument's elements (abs: their magnitudes)."""
    return node.target in _SAME_ELEMENTS or node.target is aten.abs.default or _is_dtype_preserving_copy(node)


def _is_whole_tensor_max(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is aten.max.default:
        return len(node.args) == 1 and not node.kwargs
    if node.target is aten.amax.default:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        source = _value(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        if keepdim or source is None:
            return False
        # amax over no dims, or over every dim, reduces the whole tensor
        return len(dims) == 0 or sorted(d % max(source.dim(), 1) for d in dims) == list(range(source.dim()))
    return False


def whole_tensor_max_source(node: fx.Node) -> Optional[Tuple[fx.Node, bool]]:
    """``(tensor, through_abs)`` if ``node`` is a whole-tensor max of ``tensor`` (of its ``abs`` when
    ``through_abs``), seen through element-preserving views and copies; else None."""
    if not _is_whole_tensor_max(node) or not isinstance(node.args[0], fx.Node):
        return None
    current, through_abs = node.args[0], False
    while current.op == "call_function" and current.args and isinstance(current.args[0], fx.Node):
        if not _keeps_elements(current):
            break
        # abs commutes with every view, and abs(abs(x)) == abs(x)
        through_abs = through_abs or current.target is aten.abs.default
        current = current.args[0]
    return current, through_abs


def share_amax(graph: fx.Graph) -> int:
    """Point every whole-tensor max of a tensor seen before (through any views) at the first one.

    Returns how many reductions were replaced; their now-unused views are removed.
    """
    first: Dict[Hashable, fx.Node] = {}
    replaced: List[fx.Node] = []
    for node in graph.nodes:
        found = whole_tensor_max_source(node)
        if found is None:
            continue
        out = _value(node)
        key = (found, None if out is None else (out.dtype, tuple(out.shape)))
        if key not in first:
            first[key] = node
            continue
        node.replace_all_uses_with(first[key])
        replaced.append(node)
    for node in replaced:
        _erase_unused_chain(graph, node)
    if replaced:
        logger.debug("shared_amax: %d whole-tensor max reduction(s) reuse an earlier one", len(replaced))
    return len(replaced)


def _erase_unused_chain(graph: fx.Graph, node: fx.Node) -> None:
    # the replaced reduction and the views feeding only it; the shared tensor itself stays
    while node.op == "call_function" and not node.users:
        inputs = [a for a in node.args if isinstance(a, fx.Node)]
        graph.erase_node(node)
        if len(inputs) != 1 or not _keeps_elements(inputs[0]):
            return
        node = inputs[0]


class SharedAmaxPass(InductorPass):
    """:func:`share_amax` as an Inductor joint-graph pass, e.g.
    ``torch.compile(fn, options={"joint_custom_post_pass": SharedAmaxPass()})`` (see :class:`InductorPass`
    for its cache key and equality)."""

    NAME = "shared_amax"
    VERSION = 1

    def __call__(self, graph: fx.Graph) -> None:
        share_amax(graph)

"""Rule ``shared_scaled_mm_operand``: a float8 operand that several scaled matmuls read is written once.

With dynamic float8 scaling (torchao's ``tensorwise`` recipe) q, k and v each cast the same normed
activation to float8, and after :mod:`shared_amax` and common-subexpression elimination the graph holds
that cast once, read by three ``aten._scaled_mm`` calls. Inductor still writes it three times. Its
lowering realizes a shared input only when a reader is one of the matmuls it knows to need a buffer
(``mm``, ``bmm``, ...; not ``_scaled_mm``); otherwise the cast stays a lazy pointwise expression, and
each ``_scaled_mm`` copies it into a buffer of its own. In a LLaMA-1.1B layer that is two extra float8
copies of a 8192 x 2048 activation in the forward and two of its transpose in the backward (67 MB of
writes per layer and step).

This rule flags each node that two or more scaled matmuls read as an operand with Inductor's
``inductor_realize_to_strides`` node hint, which makes the lowering compute the node into one buffer (with
the strides it has in the graph, which the matmuls already require) before its readers are lowered.

Before (Inductor's output)::

    fused_cast(x, ..., out0, out1, out2)        # three identical float8 buffers
    _scaled_mm(out0, wq, ...); _scaled_mm(out1, wk, ...); _scaled_mm(out2, wv, ...)

After::

    fused_cast(x, ..., out0)
    _scaled_mm(out0, wq, ...); _scaled_mm(out0, wk, ...); _scaled_mm(out0, wv, ...)

Exact: the same values are computed once instead of three times; the graph itself is unchanged (only
node hints are added). Used by :func:`schedlang.models.compile_layers` through Inductor's
``post_grad_custom_post_pass`` (see :class:`SharedScaledMMOperandPass`), which runs on the forward and
the backward graph just before they are lowered.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from ._inductor_pass import InductorPass

__all__ = ["mark_shared_scaled_mm_operands", "SharedScaledMMOperandPass", "REALIZE_HINT"]

logger = logging.getLogger("schedlang.graph.passes.shared_scaled_mm_operand")

aten = torch.ops.aten

#: the node hint Inductor's lowering reads (``GraphLowering.run_node``): realize the node with its strides
REALIZE_HINT = "inductor_realize_to_strides"

# the scaled matmuls that exist in this torch (``_scaled_mm_v2`` is newer than the oldest supported)
_SCALED_MM = tuple(getattr(aten, name) for name in ("_scaled_mm", "_scaled_mm_v2") if hasattr(aten, name))


def _is_scaled_mm(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in _SCALED_MM


def mark_shared_scaled_mm_operands(graph: fx.Graph) -> int:
    """Flag every computed node that two or more scaled matmuls read as a matrix operand.

    Returns how many nodes were newly flagged. Graph inputs are left alone (they are buffers already).
    """
    marked = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.meta.get(REALIZE_HINT):
            continue
        # the matrices are the first two arguments; the scales that follow are realized anyway
        readers = [user for user in node.users if _is_scaled_mm(user) and node in user.args[:2]]
        if len(readers) < 2:
            continue
        node.meta[REALIZE_HINT] = True
        marked += 1
    if marked:
        logger.debug("shared_scaled_mm_operand: %d operand(s) read by several scaled matmuls are realized once",
                     marked)
    return marked


class SharedScaledMMOperandPass(InductorPass):
    """:func:`mark_shared_scaled_mm_operands` as an Inductor post-grad pass, e.g.
    ``torch.compile(fn, options={"post_grad_custom_post_pass": SharedScaledMMOperandPass()})`` (see
    :class:`InductorPass` for its cache key and equality)."""

    NAME = "shared_scaled_mm_operand"
    VERSION = 1

    def __call__(self, graph: fx.Graph) -> None:
        mark_shared_scaled_mm_operands(graph)

"""Rule ``float8_scale_once``: a float8 scale computed in float64 is computed once, not in every cast kernel.

torchao's dynamic float8 scaling turns a tensor's amax into its scale in float64 and rounds the result to
float32: ``scale = float32(max_float8 / max(float64(amax), 1e-12))``. Inductor inlines that scalar arithmetic
into every kernel that reads the scale, so each program of a cast kernel over millions of elements first
runs a chain of float64 operations, a float64 reciprocal among them, before its first store. On an H200 that
prologue costs a kernel like the SwiGLU backward's casts in a LLaMA-1.1B layer (8192 x 5632 elements, three
scales, five float8 outputs) over a quarter of its time: 205 us with the arithmetic inlined, 147 us with the
scales computed once. In the float8 LLaMA-1.1B training step that kernel went from 4.9 to 3.8 ms per step.

This rule flags the float32 result of such a float64 scalar computation with Inductor's
``inductor_realize_to_strides`` node hint, so the lowering computes it into a one-element buffer (a tiny
kernel, or the epilogue of the amax reduction) and the cast kernels read a float32 number.

Before (Inductor's cast kernel, per program)::

    amax = load(amax_ptr); scale = float32(448.0 * (1 / max(float64(amax), 1e-12)))
    store(out, clamp(x * scale, -448, 448).to(float8))

After::

    scale = load(scale_ptr)                                  # written once by an earlier kernel
    store(out, clamp(x * scale, -448, 448).to(float8))

Numerics: the scale's float64 operations are the same, in the same order. Where the amax is an input of
the graph (the backward reading the forward's), the scale is bit for bit the one Inductor computes without
the rule. Where the amax reduction is in the same graph, Inductor takes the scale's arithmetic into the
reduction kernel's epilogue and, as it does for every value it keeps in registers, reads the maximum before
its rounding to the amax's dtype (bf16). That scale can then differ from the one without the rule in its last
bits (under one bf16 rounding of the amax, 2^-8 relative), which moves some float8 roundings by one step;
eager mode's scale, from the bf16 amax, is the one without the rule. The training check of every benchmark
row that uses the rule compares the step's loss and gradients with eager mode's.
What is flagged is strict: a conversion to a floating dtype narrower than float64 of a
one-element float64 value, read by at least one node with more than one element. Used by
:func:`schedlang.models.compile_layers` through Inductor's ``post_grad_custom_post_pass`` (see
:class:`Float8ScaleOncePass`), beside :mod:`shared_scaled_mm_operand`.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import fx

from ._inductor_pass import REALIZE_HINT, InductorPass

__all__ = ["realize_float8_scales", "Float8ScaleOncePass"]

logger = logging.getLogger("schedlang.graph.passes.float8_scale_once")

_CONVERSIONS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


def _value(node) -> Optional[torch.Tensor]:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _is_scalar_from_float64(node: fx.Node) -> bool:
    """A one-element float32/bf16/fp16 value converted from a one-element float64 value."""
    if node.op != "call_function" or node.target not in _CONVERSIONS or not node.args:
        return False
    source, result = _value(node.args[0]), _value(node)
    return (source is not None and result is not None and source.dtype == torch.float64
            and source.numel() == 1 and result.numel() == 1 and result.dtype.is_floating_point
            and result.dtype != torch.float64)


def realize_float8_scales(graph: fx.Graph) -> int:
    """Flag every float64-computed scalar that a larger tensor reads, so that Inductor computes it once.

    Returns how many nodes were newly flagged; the graph itself is left unchanged.
    """
    flagged = 0
    for node in graph.nodes:
        if node.meta.get(REALIZE_HINT) or not _is_scalar_from_float64(node):
            continue
        if not any((value := _value(user)) is not None and value.numel() > 1 for user in node.users):
            continue
        node.meta[REALIZE_HINT] = True
        flagged += 1
    if flagged:
        logger.debug("float8_scale_once: %d float64-computed scale(s) are computed once", flagged)
    return flagged


class Float8ScaleOncePass(InductorPass):
    """:func:`realize_float8_scales` as an Inductor post-grad pass, e.g.
    ``torch.compile(fn, options={"post_grad_custom_post_pass": Float8ScaleOncePass()})`` (see
    :class:`InductorPass` for its cache key and equality)."""

    NAME = "float8_scale_once"
    VERSION = 1

    def __call__(self, graph: fx.Graph) -> None:
        realize_float8_scales(graph)

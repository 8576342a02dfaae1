"""A mixture-of-experts block's experts computed with two grouped matrix products instead of a loop.

transformers 5.x keeps a block's experts in one module of 3-D tensors. In the standard layout (Qwen3-MoE,
Mixtral, OLMoE, DeepSeek-V3, ...) each expert e computes, on its rows ``x_e``::

    gate, up = F.linear(x_e, gate_up_proj[e]).chunk(2, dim=-1)     gate_up_proj [E, 2I, H]
    out_e    = F.linear(act_fn(gate) * up, down_proj[e])             down_proj    [E, H, I]

and the family's forward loops over the experts. With the rows sorted by expert, the loop is two grouped
products (:func:`~schedlang.kernels.grouped_gemm.grouped_mm`) around one elementwise activation over all
rows. :func:`standard_layout_mismatch` says whether a module is in that layout; anything else (biases,
GPT-OSS's interleaved gate and up with its clamped activation, a post-expert norm, weights stored
[E, in, out], experts without a gate) keeps the family's own forward.

Example::

    if standard_layout_mismatch(experts) is None:
        out = grouped_experts_forward(experts, rows_sorted_by_expert, counts)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from schedlang.kernels.grouped_gemm import grouped_mm

__all__ = ["standard_layout_mismatch", "grouped_experts_forward"]

#: transformers' layout flags (set by its ``use_experts_implementation`` decorator) and their standard values
_STANDARD_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                   "has_post_expert_norm": False}


def _default_gate():
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return None
    return _default_apply_gate


def standard_layout_mismatch(experts: nn.Module, family_class: Optional[type] = None) -> Optional[str]:
    """None when ``experts`` computes ``down(act(gate) * up)`` per expert from ``gate_up_proj`` [E, 2I, H] (gate
    rows first) and ``down_proj`` [E, H, I] with ``act_fn`` and nothing else; else why not, in words.

    Read from transformers' own layout flags, so a class that is not one of its experts modules (a custom
    forward, whose arithmetic cannot be read off its attributes) is never taken for the standard layout.
    ``family_class``: the class whose methods compute ``experts`` (default its own type; a module that took
    over another's attributes names the original here)."""
    family_class = family_class or type(experts)
    name = family_class.__name__
    for flag, standard in _STANDARD_FLAGS.items():
        if flag not in experts.__dict__:
            return f"{name} has no layout flag {flag!r} (not a transformers experts module)"
        if experts.__dict__[flag] != standard:
            return f"{name}.{flag} is {experts.__dict__[flag]!r}, not {standard!r}"
    names = set(name for name, p in experts.named_parameters())
    if names != {"gate_up_proj", "down_proj"}:
        return f"{name} holds parameters {sorted(names)}, not only gate_up_proj and down_proj"
    gate = getattr(family_class, "_apply_gate", None)
    if gate is None or gate is not _default_gate():
        return f"{name} gates with its own _apply_gate"
    if not callable(getattr(experts, "act_fn", None)):
        return f"{name} has no act_fn"
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0] \
            or gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
        return (f"{name} has gate_up_proj {tuple(gate_up.shape)} and down_proj "
                f"{tuple(down.shape)}, not [E, 2I, H] and [E, H, I]")
    return None


def grouped_experts_forward(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor,
                            backend: str = "auto") -> torch.Tensor:
    """Each expert of ``experts`` (standard layout, see :func:`standard_layout_mismatch`) on its rows of ``rows``
    [M, H], sorted by expert with ``counts[e]`` rows for expert e; returns [M, H], unweighted, in the same order.
    ``backend`` as for :func:`~schedlang.kernels.grouped_gemm.grouped_mm`."""
    gate_up = grouped_mm(rows, experts.gate_up_proj, counts, transposed=True, backend=backend)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = experts.act_fn(gate) * up
    return grouped_mm(hidden, experts.down_proj, counts, transposed=True, backend=backend)

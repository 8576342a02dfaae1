"""Rotary position embedding in plain PyTorch, HF LLaMA's ``apply_rotary_pos_emb`` convention.

``q`` (B, Hq, S, D) and ``k`` (B, Hk, S, D); ``cos`` / ``sin`` (B or 1, S, D), broadcast over
the heads; ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``::

    q_out = q * cos + rotate_half(q) * sin

Example::

    q, k = apply_rotary_reference(q, k, cos, sin)
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["apply_rotary_reference", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)``, cos/sin broadcast over heads."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

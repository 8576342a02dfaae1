"""LLaMA (and Mistral / Qwen2 layouts): :func:`schedlang.models.shard_llama` (grouped-query heads,
gated MLP, vocabulary-parallel embeddings and LM head) plus checkpointing. Its projections have
no bias, so nothing to fuse with the SiLU."""

from __future__ import annotations

from ._base import delegate
from .registry import register_schedule

__all__ = ["apply"]


@register_schedule()
def apply(model, **sch_config):
    from ..models import shard_llama

    return delegate(model, sch_config, "llama", shard_llama, "model", "layers")

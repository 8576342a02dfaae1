"""GPT-2 (``GPT2LMHeadModel`` / ``GPT2Model``): :func:`schedlang.models.shard_gpt2` (heads of the
fused ``c_attn``, the MLP, vocabulary-parallel embeddings and LM head) plus checkpointing.
GPT-2's projections are HF ``Conv1D``s, so there is no Linear to fuse the bias with."""

from __future__ import annotations

from ._base import delegate
from .registry import register_schedule

__all__ = ["apply"]


@register_schedule()
def apply(model, **sch_config):
    from ..models import shard_gpt2

    return delegate(model, sch_config, "gpt2", shard_gpt2, "transformer", "h")

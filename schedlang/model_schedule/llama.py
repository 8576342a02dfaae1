"""LLaMA (and Mistral / Qwen2 layouts): :func:`schedlang.models.shard_llama` (grouped-query heads,
gated MLP, vocabulary-parallel embeddings and LM head) plus checkpointing. Its projections have
no bias, so nothing to fuse with the SiLU."""

from __future__ import annotations

from ._base import finish, prepare
from .registry import register_schedule

__all__ = ["apply"]


@register_schedule()
def apply(model, **sch_config):
    from ..models import shard_llama

    sch = prepare(model, sch_config, "llama")
    if sch.world_size > 1:
        shard_llama(sch, sequence_parallel=sch_config.get("sequence_parallel", False),
                    gather_logits=sch_config.get("gather_logits", True))
    base = sch["model"] if "model" in sch.child else sch
    return finish(sch, "llama", list(base["layers"].child.values()), sch_config)

"""Ready-made schedules per HF model family (Slapo's ``slapo.model_schedule``), for transformers 5.x.

``apply_schedule(model, name, **options)`` with ``name`` one of ``gpt2``, ``gpt_neo``, ``opt``,
``llama``, ``bert``, ``roberta``, ``albert``, ``t5``: tensor parallelism over the schedule's
group (heads, MLPs; vocabulary-parallel embeddings where :mod:`schedlang.models` has them),
activation checkpointing of a fraction of the layers (``ckpt_ratio``) and fused bias + activation
(``fuse=True``). Each writes ordinary schedule steps, so ``Verify`` checks them and the plan
replays them.
"""

from __future__ import annotations

from .api import apply_schedule
from .registry import FAMILIES, get_schedule, register_schedule

__all__ = ["apply_schedule", "get_schedule", "register_schedule", "FAMILIES"]

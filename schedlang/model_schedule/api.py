"""``apply_schedule(model, "gpt2", **sch_config)``: the ready-made schedule of a model family."""

from __future__ import annotations

from typing import Any

from .registry import get_schedule

__all__ = ["apply_schedule"]


def apply_schedule(model, schedule_key: str, **sch_config: Any):
    """Schedule ``model`` (an ``nn.Module`` or a ``Schedule``) with the family schedule
    ``schedule_key``; returns the schedule. Options (all families): ``group`` / ``mesh``,
    ``ckpt_ratio`` (checkpoint that fraction of the layers, the first ones), ``fuse`` (fused
    bias + activation), ``fp16`` / ``bf16``, and the family's own (``sequence_parallel`` ...).

    Example::

        sch = apply_schedule(GPT2LMHeadModel(config), "gpt2", ckpt_ratio=0.5)
        model, opt = schedlang.build(sch, optimizer="adamw")
    """
    return get_schedule(schedule_key)(model, **sch_config)

"""Ready-made tensor-parallel schedules for HF model families (transformers 5.x), one file each.

Each ``shard_<family>(sch, sequence_parallel=False, gather_logits=False)`` writes the ``shard``
and ``sync`` steps of Megatron-style tensor parallelism (attention heads, MLP, vocabulary-
parallel embeddings and LM head; optionally sequence parallelism) into a schedule, so they
are recorded in its plan, checked by ``Verify`` and materialized per rank by ``build``::

    from schedlang.models import shard_llama
    sch = schedlang.create_schedule(model)
    shard_llama(sch, sequence_parallel=True)
    model, opt = schedlang.build(sch, optimizer="adamw")

:func:`shard_model` picks the schedule from the model's class.
"""

from __future__ import annotations

from ..errors import ScheduleTypeError
from .bert import shard_bert
from .gpt2 import shard_gpt2
from .llama import shard_llama

__all__ = ["shard_llama", "shard_gpt2", "shard_bert", "shard_model", "FAMILIES"]

#: class-name prefix -> schedule function
FAMILIES = {"Llama": shard_llama, "Mistral": shard_llama, "Qwen2": shard_llama, "GPT2": shard_gpt2,
            "Bert": shard_bert}


def shard_model(sch, **options):
    """Apply the tensor-parallel schedule of ``sch``'s model family (see :data:`FAMILIES`); returns ``sch``.

    Example::

        shard_model(schedlang.create_schedule(GPT2LMHeadModel(config)), sequence_parallel=True)
    """
    name = type(sch.mod).__name__
    for prefix, fn in FAMILIES.items():
        if name.startswith(prefix):
            return fn(sch, **options)
    raise ScheduleTypeError(f"{sch.path or '<root>'}: no ready-made schedule for {name}; known families: "
                            f"{', '.join(FAMILIES)}")

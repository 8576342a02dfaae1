"""GPT-2 (``GPT2LMHeadModel`` / ``GPT2Model``): :func:`schedlang.models.shard_gpt2` (heads of the
fused ``c_attn``, the MLP, vocabulary-parallel embeddings and LM head) plus checkpointing.
GPT-2's projections are HF ``Conv1D``s, so there is no Linear to fuse the bias with."""

from __future__ import annotations

from ._base import delegate
from .registry import register_schedule

__all__ = ["apply", "gen_embedding_hooks"]


@register_schedule()
def apply(model, **sch_config):
    from ..models import shard_gpt2

    return delegate(model, sch_config, "gpt2", shard_gpt2, "transformer", "h")


def gen_embedding_hooks(sch, vocab_size):
    """The ``(fwd_pre, fwd_post)`` sync functions of a vocabulary-parallel word embedding.

    For ``sch["wte"].shard("weight", axis=0)`` followed by
    ``sync(mode="fwd_pre", sync_op_or_fn=pre)`` and ``sync(mode="fwd_post", sync_op_or_fn=post)``.
    The sharded embedding already looks up only the ids of its own rows and returns zero rows
    for the others (:class:`schedlang.distributed.shard_rules.embedding.VocabParallelEmbedding`),
    so ``pre`` only checks that the ids lie in ``[0, vocab_size)`` and ``post`` sums the partial
    embeddings over ``sch.group``. Written as ``fn(tensor) -> tensor``, the form ``sync`` takes.

    Example::

        sch["transformer.wte"].shard("weight", axis=0)
        pre, post = gen_embedding_hooks(sch, model.config.vocab_size)
        sch["transformer.wte"].sync(mode="fwd_pre", sync_op_or_fn=pre)
        sch["transformer.wte"].sync(mode="fwd_post", sync_op_or_fn=post)
    """
    from ..distributed import collectives
    from ..errors import ScheduleValueError

    where = sch.path or "<root>"
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < sch.world_size:
        raise ScheduleValueError(f"{where}: gen_embedding_hooks needs the vocabulary size as an int of at least the "
                                 f"group size {sch.world_size}, got {vocab_size!r}")
    group = sch.group

    def embedding_ids_in_range(ids):
        if not ids.is_floating_point() and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ScheduleValueError(f"{where}: embedding ids must lie in [0, {vocab_size}), got values in "
                                     f"[{int(ids.min())}, {int(ids.max())}]")
        return ids

    def sum_partial_embeddings(output):
        return collectives.reduce_forward(output, group) if sch.world_size > 1 else output

    return embedding_ids_in_range, sum_partial_embeddings

"""Shard rule for ``nn.Embedding`` (weight of shape (num_embeddings, embedding_dim)).

* axis 0 (vocabulary parallel): rank r holds rows ``[r*V/w, (r+1)*V/w)``. The module is replaced
  by a :class:`VocabParallelEmbedding` holding the same table: it remembers its vocabulary range,
  looks up the ids that fall inside it and returns zero rows for the others, so that a ``fwd_post``
  ``all_reduce`` (or a ``reduce_scatter`` along the sequence, for sequence parallelism) yields the
  full embedding.
  The backward needs no collective: each rank's rows receive exactly their tokens' gradients.
* axis 1 (hidden parallel): rank r holds columns ``[r*D/w, (r+1)*D/w)`` of every row; the output
  is a slice of the hidden size and a ``fwd_post`` ``all_gather`` with ``axis=-1`` makes it whole.

Example (vocabulary parallel)::

    sch["embed_tokens"].shard("weight", axis=0)
    sch["embed_tokens"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ShardError
from ..sharding import remember_unsharded
from . import ShardRule, register_shard_rule

__all__ = ["EmbeddingShardRule", "VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Embedding):
    """An ``nn.Embedding`` holding rows ``[vocab_start_index, vocab_end_index)`` of the full table.

    Ids outside that range give zero rows (their gradient is zero too); the sum over ranks of
    the outputs is the unsharded embedding.
    """

    vocab_start_index: int = 0
    vocab_end_index: int = 0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        outside = (input < self.vocab_start_index) | (input >= self.vocab_end_index)
        # out-of-range ids are looked up as local row 0 and zeroed afterwards
        local = (input - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                          self.scale_grad_by_freq, self.sparse)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, vocab_range=[{self.vocab_start_index}, {self.vocab_end_index})"


def _overrides_forward(klass: type) -> bool:
    return klass.forward is not nn.Embedding.forward and klass.forward is not VocabParallelEmbedding.forward


def _forward_calls_super(klass: type) -> bool:
    """Whether ``klass.forward`` looks its ids up through ``super().forward`` (GemmaTextScaledWordEmbedding
    scales the result of ``super().forward(input_ids)``), so the masked lookup can take its place."""
    import inspect
    import textwrap

    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(klass.forward)))
    except (OSError, TypeError):
        return False
    return "super().forward(" in source


def vocab_parallel_class(klass: type) -> type:
    """The vocabulary-parallel form of an Embedding class: :class:`VocabParallelEmbedding` itself for
    ``nn.Embedding``, else a subclass of both whose own forward runs on the masked lookup."""
    if klass is nn.Embedding or issubclass(klass, VocabParallelEmbedding):
        return VocabParallelEmbedding if klass is nn.Embedding else klass
    name = f"VocabParallel{klass.__name__}"
    made = globals().get(name)
    if made is None or made.__bases__ != (klass, VocabParallelEmbedding):
        made = type(name, (klass, VocabParallelEmbedding), {"__module__": __name__})
        globals()[name] = made  # importable by name, so a sharded model can be pickled
    return made


@register_shard_rule
class EmbeddingShardRule(ShardRule):
    module_types = (nn.Embedding,)
    match_subclasses = True

    @classmethod
    def check(cls, path, module, tensor_name, axis, world_size):
        where = path or "<root>"
        if axis == 0 and module.max_norm is not None:
            raise ShardError(
                f"{where}: cannot shard 'weight' of an Embedding with max_norm={module.max_norm} along the vocabulary "
                "(axis 0): renormalizing looked-up rows would also rescale the row that out-of-range ids borrow; "
                "shard along axis 1 or set max_norm=None")
        if axis == 0 and module.scale_grad_by_freq:
            raise ShardError(
                f"{where}: cannot shard 'weight' of an Embedding with scale_grad_by_freq=True along the vocabulary "
                "(axis 0): the masked ids would be counted as local row 0; shard along axis 1 instead")
        klass = type(module)
        if axis == 0 and _overrides_forward(klass) and not _forward_calls_super(klass):
            raise ShardError(
                f"{where}: cannot shard 'weight' of {klass.__name__} along the vocabulary (axis 0): its forward "
                "does not look ids up through super().forward, so the masked vocabulary-parallel lookup cannot take "
                "its place; shard along axis 1 instead, or replace the module by an nn.Embedding first")

    @classmethod
    def replacement_class(cls, module, tensor_name, axis, world_size, rank):
        if tensor_name != "weight" or axis != 0:
            return None
        klass = vocab_parallel_class(type(module))
        return None if klass is type(module) else klass

    @classmethod
    def after_shard(cls, module, tensor_name, axis, world_size, rank):
        if tensor_name != "weight":
            return
        rows, dim = module.weight.shape
        if axis == 1:
            remember_unsharded(module, embedding_dim=module.embedding_dim)
            module.embedding_dim = dim
            return
        full_rows = module.num_embeddings
        remember_unsharded(module, num_embeddings=full_rows, padding_idx=module.padding_idx)
        start = rank * rows
        padding = module.padding_idx
        module.num_embeddings = rows
        module.vocab_start_index = start
        module.vocab_end_index = start + rows
        # the padding row keeps a zero gradient on the rank that holds it; on the others there is none
        module.padding_idx = padding - start if padding is not None and start <= padding < start + rows else None

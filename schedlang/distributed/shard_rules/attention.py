"""Shard rules for HF attention modules whose head count must follow their projections' shards.

An attention module owns no weights itself; its projections do. When a projection is
sharded (the ``shard`` primitive asks the parent's rule, see
:mod:`schedlang.primitives.shard`), the rule here

* checks that every rank gets whole heads (``ShardError`` otherwise, naming the head count and
  the world sizes that would work),
* asks for the fused layout where one projection holds q, k and v (GPT-2's ``c_attn``), so that
  each rank holds its own heads of all three: [q_r, k_r, v_r],
* and afterwards updates the attributes the module's forward reads.

What transformers 5.x reads in forward:

* ``LlamaAttention`` (and Mistral / Qwen2, same layout): shapes ``(*, -1, head_dim)``, so the
  local head count follows from the local projection size; ``num_key_value_groups`` (used by
  the SDPA and eager attention to repeat k/v heads) is kept equal to local q heads / local kv
  heads, and ``num_heads`` / ``num_key_value_heads`` are set to the local counts for reading.
* ``GPT2Attention``: ``split_size`` (the width of q, k and v in ``c_attn``'s output) is read in
  forward and becomes ``hidden / world``; ``num_heads`` is set to the local count.
* ``BertSelfAttention``: shapes ``(*, -1, attention_head_size)``; ``num_attention_heads`` and
  ``all_head_size`` are set to the local counts.
"""

from __future__ import annotations

from typing import Optional

from ...errors import ShardError
from ..sharding import remember_unsharded
from . import ShardRule, register_shard_rule

__all__ = ["LlamaAttentionShardRule", "GPT2AttentionShardRule", "BertSelfAttentionShardRule"]


def _require_whole_heads(path: str, tensor_name: str, axis: int, world: int, size: int, head_dim: int,
                         what: str) -> None:
    heads = size // head_dim
    if heads % world:
        valid = ", ".join(str(w) for w in range(1, heads + 1) if heads % w == 0)
        raise ShardError(
            f"{path or '<root>'}: cannot shard '{tensor_name}' along axis {axis} over {world} ranks: {what} has "
            f"{heads} heads of size {head_dim} and every rank must hold whole heads; valid world sizes: {valid}")


@register_shard_rule
class LlamaAttentionShardRule(ShardRule):
    module_type_names = ("LlamaAttention", "MistralAttention", "Qwen2Attention")

    _QKV = {"q_proj": "the query projection", "k_proj": "the key projection", "v_proj": "the value projection"}

    @classmethod
    def check_child_shard(cls, path, module, child_name, child, tensor_name, axis, world_size) -> Optional[int]:
        size = getattr(child, tensor_name).shape[axis]
        if child_name in cls._QKV and axis == 0:
            _require_whole_heads(path, tensor_name, axis, world_size, size, module.head_dim, cls._QKV[child_name])
        elif child_name == "o_proj" and tensor_name == "weight" and axis == 1:
            _require_whole_heads(path, tensor_name, axis, world_size, size, module.head_dim,
                                 "the input of the output projection")
        return 1

    @classmethod
    def after_child_shard(cls, module, child_name, child, tensor_name, axis, world_size, rank):
        if child_name not in cls._QKV:
            return
        config = module.config
        remember_unsharded(module, num_key_value_groups=module.num_key_value_groups,
                           num_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads)
        q_heads = module.q_proj.weight.shape[0] // module.head_dim
        kv_heads = module.k_proj.weight.shape[0] // module.head_dim
        module.num_heads = q_heads
        module.num_key_value_heads = kv_heads
        if q_heads % kv_heads == 0:  # between the q and the k/v shard the counts are briefly inconsistent
            module.num_key_value_groups = q_heads // kv_heads


@register_shard_rule
class GPT2AttentionShardRule(ShardRule):
    module_type_names = ("GPT2Attention",)

    @classmethod
    def check_child_shard(cls, path, module, child_name, child, tensor_name, axis, world_size) -> Optional[int]:
        if child_name in ("c_attn", "q_attn") and module.is_cross_attention:
            raise ShardError(
                f"{path or '<root>'}: cannot shard '{tensor_name}': its parent is a cross-attention GPT2Attention, and "
                "only self-attention (q|k|v fused in c_attn) can be sharded head-wise")
        fused_output = (tensor_name == "weight" and axis == 1) or (tensor_name == "bias" and axis == 0)
        if child_name == "c_attn" and fused_output:
            size = getattr(child, tensor_name).shape[axis] // 3
            _require_whole_heads(path, tensor_name, axis, world_size, size, module.head_dim,
                                 "each of q, k and v in the fused projection")
            return 3  # q | k | v: split each block, rank r gets [q_r, k_r, v_r]
        if child_name == "c_proj" and tensor_name == "weight" and axis == 0:
            _require_whole_heads(path, tensor_name, axis, world_size, child.weight.shape[0], module.head_dim,
                                 "the input of the output projection")
        return 1

    @classmethod
    def after_child_shard(cls, module, child_name, child, tensor_name, axis, world_size, rank):
        if child_name != "c_attn" or tensor_name != "weight" or axis != 1:
            return
        remember_unsharded(module, split_size=module.split_size, num_heads=module.num_heads)
        module.split_size = child.weight.shape[1] // 3
        module.num_heads = module.split_size // module.head_dim


@register_shard_rule
class BertSelfAttentionShardRule(ShardRule):
    module_type_names = ("BertSelfAttention", "RobertaSelfAttention")

    _QKV = {"query": "the query projection", "key": "the key projection", "value": "the value projection"}

    @classmethod
    def check_child_shard(cls, path, module, child_name, child, tensor_name, axis, world_size) -> Optional[int]:
        if child_name in cls._QKV and axis == 0:
            _require_whole_heads(path, tensor_name, axis, world_size, getattr(child, tensor_name).shape[0],
                                 module.attention_head_size, cls._QKV[child_name])
        return 1

    @classmethod
    def after_child_shard(cls, module, child_name, child, tensor_name, axis, world_size, rank):
        if child_name != "query" or tensor_name != "weight" or axis != 0:
            return
        remember_unsharded(module, num_attention_heads=module.num_attention_heads, all_head_size=module.all_head_size)
        module.num_attention_heads = child.weight.shape[0] // module.attention_head_size
        module.all_head_size = module.num_attention_heads * module.attention_head_size

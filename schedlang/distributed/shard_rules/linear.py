"""Shard rule for ``nn.Linear`` (weight of shape (out_features, in_features)).

* weight axis 0 (column parallel): each rank computes ``out_features / world`` outputs;
  the bias, if any, must be sharded along axis 0 too.
* weight axis 1 (row parallel): each rank computes a partial sum over its inputs. The
  partial sums are added by a ``fwd_post`` all-reduce, and the bias must be added once,
  after it: the module is replaced by a :class:`~schedlang.primitives.decompose.LinearWithSeparateBias`
  (holding the same parameters) that runs its forward-post syncs before adding the (unsharded) bias.
"""

from __future__ import annotations

from torch import nn

from ...errors import ShardError
from ...module_record import shard_specs
from . import ShardRule, follow_sharded_weight, refuse_bias_of_row_parallel, register_shard_rule


@register_shard_rule
class LinearShardRule(ShardRule):
    module_types = (nn.Linear,)
    match_subclasses = True

    @classmethod
    def check(cls, path, module, tensor_name, axis, world_size):
        from ...primitives.decompose import LinearWithSeparateBias

        shards = shard_specs(module)
        refuse_bias_of_row_parallel(path, "Linear", shards, tensor_name, row_axis=1)
        if (tensor_name == "weight" and axis == 1 and module.bias is not None
                and type(module) not in (nn.Linear, LinearWithSeparateBias)):
            raise ShardError(
                f"{path or '<root>'}: cannot shard 'weight' along axis 1 of {type(module).__name__} (a Linear subclass "
                "with a bias): the bias must be added after the all-reduce, which schedlang can only arrange for "
                "nn.Linear; replace the module first or shard along axis 0")
        if tensor_name == "weight" and axis == 1 and shards.get("bias") is not None:
            raise ShardError(
                f"{path or '<root>'}: cannot shard 'weight' along axis 1: 'bias' is already sharded along axis 0 "
                "(column parallel); a row-parallel Linear keeps its bias whole; shard the bias only with a "
                "column-parallel weight (axis 0)")

    @classmethod
    def replacement_class(cls, module, tensor_name, axis, world_size, rank):
        from ...primitives.decompose import LinearWithSeparateBias

        if tensor_name == "weight" and axis == 1 and module.bias is not None and type(module) is nn.Linear:
            return LinearWithSeparateBias
        return None

    @classmethod
    def after_shard(cls, module, tensor_name, axis, world_size, rank):
        follow_sharded_weight(module, tensor_name, axis, ("out_features", "in_features"), row_axis=1, remember=False)

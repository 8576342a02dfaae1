"""Shard rule for the Linears of ``schedlang.op`` whose bias add is fused with what follows
(``LinearWithSyncFunc`` and its subclasses ``LinearWithAct``, ``LinearWithDropout``).

* weight axis 0 (column parallel): each rank computes ``out_features / world`` outputs; the bias
  must be sharded along axis 0 too, and the fused activation / dropout acts on this rank's slice.
* weight axis 1 (row parallel): each rank computes a partial sum. The module's own forward runs
  its forward-post syncs on ``x @ W.T`` before the fused bias add (``syncs_before_bias`` in its
  record), so ``LinearWithDropout`` computes ``dropout(all_reduce(x_local @ W_local.T) + b)``
  exactly as the unsharded module does. No class change is needed.
"""

from __future__ import annotations

from ...errors import ShardError
from ...module_record import shard_specs
from ...op.linear import LinearWithAct, LinearWithDropout, LinearWithSyncFunc
from . import ShardRule, follow_sharded_weight, refuse_bias_of_row_parallel, register_shard_rule

__all__ = ["FusedBiasLinearShardRule"]

# the forwards that run the syncs before the bias; a subclass with its own forward may not
_SYNCING_FORWARDS = (LinearWithSyncFunc.forward, LinearWithAct.forward, LinearWithDropout.forward)


@register_shard_rule
class FusedBiasLinearShardRule(ShardRule):
    module_types = (LinearWithSyncFunc,)
    match_subclasses = True

    @classmethod
    def check(cls, path, module, tensor_name, axis, world_size):
        where = path or "<root>"
        kind = type(module).__name__
        shards = shard_specs(module)
        refuse_bias_of_row_parallel(path, kind, shards, tensor_name, row_axis=1)
        if tensor_name == "bias" and axis != 0:
            raise ShardError(
                f"{where}: cannot shard 'bias' of {kind} along axis {axis}: a bias has one axis; valid is axis 0 "
                "(with the weight along axis 0, column parallel)")
        if tensor_name == "weight" and axis == 1 and module.bias is not None and \
                type(module).forward not in _SYNCING_FORWARDS:
            raise ShardError(
                f"{where}: cannot shard 'weight' along axis 1 of {kind}: it overrides forward, so its bias cannot "
                "be added after the all-reduce; shard along axis 0, or keep the forward of LinearWithSyncFunc, "
                "LinearWithAct or LinearWithDropout")
        if tensor_name == "weight" and axis == 1 and "bias" in shards:
            raise ShardError(
                f"{where}: cannot shard 'weight' along axis 1: 'bias' is already sharded along axis 0 (column "
                f"parallel); a row-parallel {kind} keeps its bias whole; shard the bias only with a column-parallel "
                "weight (axis 0)")

    @classmethod
    def after_shard(cls, module, tensor_name, axis, world_size, rank):
        follow_sharded_weight(module, tensor_name, axis, ("out_features", "in_features"), row_axis=1)

"""Slapo's sharding helpers under their Slapo paths.

* :mod:`.sync_ops`: the differentiable collectives a schedule inserts (``reduce_forward_output``
  ...), on top of :mod:`schedlang.distributed.collectives`;
* :mod:`.reshard_ops`: ``"RS->SR"``-style resharding of activations;
* :mod:`.shard_ops`: per-module-type descriptions of a shard (output type, attributes to fix).
"""

from .shard_ops import (ShardBatchNorm2d, ShardConv1D, ShardConv2d, ShardLinear, ShardMethod, apply_shard_method,
                        apply_sync_method, dispatch_shard_method_cls, new_or_get_tied_param, register_shard_method)
from .sync_ops import (all_gather_forward_output, reduce_backward_grad, reduce_forward_output,
                       reduce_scatter_forward_output, scatter_forward_output)

__all__ = ["all_gather_forward_output", "reduce_backward_grad", "reduce_forward_output",
           "reduce_scatter_forward_output", "scatter_forward_output", "ShardMethod", "ShardLinear", "ShardConv2d",
           "ShardConv1D", "ShardBatchNorm2d", "register_shard_method", "dispatch_shard_method_cls",
           "apply_shard_method", "apply_sync_method", "new_or_get_tied_param"]

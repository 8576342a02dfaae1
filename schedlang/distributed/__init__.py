"""torch.distributed glue: process groups, autograd-aware collectives, sync points, shard rules."""

from .collectives import (gather_forward, reduce_backward, reduce_forward, reduce_scatter_forward,
                          scatter_forward)
from .groups import is_distributed, rank, world_size
from .sharding import ShardSpec, shard_source, shard_specs

__all__ = [
    "gather_forward", "reduce_backward", "reduce_forward", "reduce_scatter_forward", "scatter_forward",
    "is_distributed", "rank", "world_size", "ShardSpec", "shard_source", "shard_specs",
]

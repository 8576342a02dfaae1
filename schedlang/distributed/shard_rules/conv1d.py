"""Shard rule for HF ``Conv1D`` (``transformers.pytorch_utils.Conv1D``, used by GPT-2).

``Conv1D`` is a linear layer with the weight stored transposed: shape (in ``nx``, out ``nf``),
``y = x @ weight + bias``. So the axes are the other way round from ``nn.Linear``:

* weight axis 1 (column parallel): each rank computes ``nf / world`` outputs; shard the bias
  along axis 0 as well;
* weight axis 0 (row parallel): each rank computes a partial sum over its inputs. The module
  is replaced by a ``RowParallelConv1D`` (holding the same parameters) that runs its ``fwd_post``
  syncs (the all-reduce, or the reduce-scatter of sequence parallelism) before adding the bias,
  so that the bias is added once.

GPT-2's fused attention projection ``c_attn`` (q | k | v along the output axis) is split
head-wise, each rank getting [q_r, k_r, v_r]: its parent's rule (GPT2Attention, see
``attention.py``) asks for that layout.

Example (GPT-2 MLP)::

    sch["mlp.c_fc"].shard("weight", axis=1); sch["mlp.c_fc"].shard("bias", axis=0)
    sch["mlp.c_proj"].shard("weight", axis=0)
    sch["mlp.c_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["mlp"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
"""

from __future__ import annotations

from typing import Dict

import torch

from ...errors import ShardError
from ...module_record import shard_specs
from ..sync_ops import bias_after_inner_syncs, run_post_syncs
from . import ShardRule, follow_sharded_weight, refuse_bias_of_row_parallel, register_shard_rule

__all__ = ["Conv1DShardRule", "row_parallel_conv1d_class"]

_ROW_PARALLEL_CLASSES: Dict[type, type] = {}


def _row_parallel_forward(self, x: torch.Tensor) -> torch.Tensor:
    size_out = x.size()[:-1] + (self.nf,)
    out = run_post_syncs(self, torch.mm(x.reshape(-1, x.size(-1)), self.weight).view(size_out))
    return out + bias_after_inner_syncs(self, self.bias)


def row_parallel_conv1d_class(base: type) -> type:
    """The row-parallel subclass of ``base`` (a Conv1D class): bias added after the forward-post syncs."""
    klass = _ROW_PARALLEL_CLASSES.get(base)
    if klass is None:
        klass = type("RowParallelConv1D", (base,), {
            "forward": _row_parallel_forward,
            "__doc__": "Row-parallel Conv1D: partial product, forward-post syncs, then the (whole) bias.",
            "__module__": __name__,
        })
        _ROW_PARALLEL_CLASSES[base] = klass
    return klass


@register_shard_rule
class Conv1DShardRule(ShardRule):
    module_type_names = ("Conv1D", "RowParallelConv1D")

    @classmethod
    def check(cls, path, module, tensor_name, axis, world_size):
        where = path or "<root>"
        shards = shard_specs(module)
        refuse_bias_of_row_parallel(path, "Conv1D", shards, tensor_name, row_axis=0)
        if tensor_name == "weight" and axis == 0 and "bias" in shards:
            raise ShardError(
                f"{where}: cannot shard 'weight' along axis 0 (row parallel): 'bias' is already sharded (column "
                "parallel); a row-parallel Conv1D keeps its bias whole; shard the bias only with a column-parallel "
                "weight (axis 1)")

    @classmethod
    def replacement_class(cls, module, tensor_name, axis, world_size, rank):
        if tensor_name != "weight" or axis != 0 or type(module) in _ROW_PARALLEL_CLASSES.values():
            return None
        return row_parallel_conv1d_class(type(module))

    @classmethod
    def after_shard(cls, module, tensor_name, axis, world_size, rank):
        follow_sharded_weight(module, tensor_name, axis, ("nx", "nf"), row_axis=0)


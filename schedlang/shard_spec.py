"""``ShardSpec``: how one tensor of a module is split over the ranks of its tensor-parallel dimension.

Plain data, held in the owning module's record (:mod:`schedlang.module_record`) and read by ``build``,
checkpointing, ``Verify``, pretrained loading and the report. It sits below all of them, so each can
import it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

__all__ = ["ShardSpec"]


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How one tensor of a module is split: along ``axis`` into ``world_size`` equal parts, part ``rank``.

    ``groups`` > 1 describes a fused tensor: ``axis`` holds ``groups`` equal blocks (GPT-2's
    ``c_attn`` holds q | k | v), each block is split into ``world_size`` parts, and the shard is
    the concatenation of part ``rank`` of every block (rank r gets [q_r, k_r, v_r]). With the
    default ``groups=1`` the shard is one contiguous slice.

    ``blocks`` gives the (full) sizes of blocks of unequal widths instead (Phi-3's ``qkv_proj`` with
    fewer key/value heads than query heads: ``(q, kv, kv)``); each is split the same way, and
    ``groups`` is then ``len(blocks)``.

    No DTensor placement describes such a shard, so a built model lays its DTensor out *rank-major*
    (:attr:`rank_major`): the DTensor's global tensor is the unsharded one with its rows along
    ``axis`` re-ordered so that each rank's shard is one contiguous chunk (``Shard(axis)``).
    :meth:`rank_major_order` is that re-ordering; whatever reads the global value (checkpoints,
    export, pretrained loading) maps it back through the spec.
    """

    axis: int
    world_size: int
    rank: int
    full_shape: Tuple[int, ...]
    groups: int = 1
    blocks: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        if self.blocks is not None:
            object.__setattr__(self, "blocks", tuple(int(b) for b in self.blocks))
            object.__setattr__(self, "groups", len(self.blocks))

    def block_sizes(self, length: int) -> Tuple[int, ...]:
        """The full sizes of the blocks along ``axis`` of a tensor ``length`` long there."""
        if self.blocks is not None:
            return self.blocks
        return (length // self.groups,) * self.groups

    @property
    def rank_major(self) -> bool:
        """Whether a DTensor of this shard holds the rank-major re-ordering of the unsharded tensor (blocks of
        unequal widths, see the class docstring) rather than the unsharded tensor itself."""
        return self.blocks is not None and len(set(self.blocks)) > 1

    def rank_major_order(self) -> torch.Tensor:
        """Indices along ``axis``: position ``j`` of the rank-major layout holds index ``order[j]`` of the
        unsharded tensor (rank 0's [q_0, k_0, v_0], then rank 1's ...). ``unsharded.index_select(axis, order)``
        is the rank-major tensor; ``rank_major.index_select(axis, argsort(order))`` the unsharded one."""
        length = int(self.full_shape[self.axis])
        starts, start = [], 0
        for block in self.block_sizes(length):
            starts.append((start, block // self.world_size))
            start += block
        return torch.cat([torch.arange(s + r * size, s + (r + 1) * size)
                          for r in range(self.world_size) for s, size in starts])

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's part of the unsharded tensor ``full`` (a view when ``groups == 1``)."""
        if self.groups == 1:
            size = full.shape[self.axis] // self.world_size
            return full.narrow(self.axis, self.rank * size, size)
        parts, start = [], 0
        for block in self.block_sizes(full.shape[self.axis]):
            size = block // self.world_size
            parts.append(full.narrow(self.axis, start + self.rank * size, size))
            start += block
        return torch.cat(parts, dim=self.axis)

"""Shard bookkeeping: what was split, how, and where each shard came from.

What a shard is lives in one place, the owning module's record
(:mod:`schedlang.module_record`): ``shards[name] = ShardSpec(...)``, plain data that survives
``copy.deepcopy`` and is what ``build``, checkpointing and the report read.

Beside it this module keeps an *index*, derived from the same ``ShardSpec`` when ``shard``
runs: a weak map from the new tensor to the tensor it was cut from. It holds no fact of its
own (the spec is the record's); it only lets ``Verify`` find a shard's unsharded counterpart
by tensor identity, even after graph rewrites moved the parameter to another module. It
forgets a shard once either tensor is gone.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Dict, Optional, Tuple

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .. import module_record as records

__all__ = ["ShardSpec", "ShardSource", "shard_tensor", "shard_source", "record_shard_source", "shard_specs",
           "remember_unsharded", "unsharded_view"]


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


@dataclasses.dataclass
class ShardSource:
    source: "weakref.ReferenceType[torch.Tensor]"
    spec: ShardSpec


# the counterpart index: keyed by tensor identity (tensors compare elementwise, so an ordinary weak
# dict cannot hold them)
_SOURCES = WeakIdKeyDictionary()


def shard_tensor(t: torch.Tensor, axis: int, rank: int, world_size: int, groups: int = 1,
                 blocks: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """A fresh (non-aliasing) copy of this rank's slice of ``t`` along ``axis`` (see :class:`ShardSpec`
    for ``groups`` and ``blocks``)."""
    if groups == 1 and blocks is None:
        size = t.shape[axis] // world_size
        return t.detach().narrow(axis, rank * size, size).clone()
    return ShardSpec(axis, world_size, rank, tuple(t.shape), groups, blocks).slice_of(t.detach()).contiguous()


def record_shard_source(shard: torch.Tensor, source: torch.Tensor, spec: ShardSpec) -> None:
    """Index ``shard`` as cut from ``source`` as ``spec`` says (``spec`` is also in the owner's record)."""
    prior = _SOURCES.get(source)
    if prior is not None and prior.source() is not None:
        # a shard of a shard: remember the original tensor and compose the slicing
        outer = prior.spec
        if outer.axis == spec.axis and outer.groups == 1 and spec.groups == 1:
            spec = ShardSpec(spec.axis, outer.world_size * spec.world_size,
                             outer.rank * spec.world_size + spec.rank, outer.full_shape)
            source = prior.source()
    _SOURCES[shard] = ShardSource(weakref.ref(source), spec)


def shard_source(t: torch.Tensor) -> Optional[Tuple[torch.Tensor, ShardSpec]]:
    """``(source_tensor, spec)`` if ``t`` was produced by sharding a tensor still alive, else None."""
    entry = _SOURCES.get(t)
    if entry is None:
        return None
    src = entry.source()
    return None if src is None else (src, entry.spec)


def shard_specs(module: nn.Module) -> Dict[str, ShardSpec]:
    """The shard records of ``module``'s own tensors (name -> spec), read from its record."""
    return records.shard_specs(module)


def remember_unsharded(module: nn.Module, **attributes) -> None:
    """Record the given attributes of ``module`` as they were before any shard.

    Shard rules call this before they change a module (a vocabulary-parallel embedding
    changes ``num_embeddings`` and ``padding_idx``; the replacement module of another class that
    ``shard`` installs records the original class); ``build`` uses the
    record to initialize a meta-device module at full size exactly as the unsharded module
    would be. The first record of an attribute wins, so a second shard keeps the original values.
    """
    records.remember_original(module, **attributes)


def unsharded_view(module: nn.Module):
    """``(class, attributes)`` of ``module`` before sharding (its current ones if it was never changed)."""
    return records.original_view(module)

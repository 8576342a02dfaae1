"""Shard bookkeeping: what was split, how, and where each shard came from.

Two records are kept for every sharded tensor:

* ``module._schedlang_shards[name] = ShardSpec(...)`` on the owning module: plain data that
  survives ``copy.deepcopy`` and is what ``build`` uses to materialize meta-device shards;
* a weak map from the new ``Parameter`` to the tensor it was cut from, which lets
  ``Verify`` compare a shard's gradient with the matching slice of the full gradient even
  after graph rewrites moved the parameter to another module.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Dict, Optional, Tuple

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ShardSpec", "ShardSource", "shard_tensor", "shard_source", "record_shard_source", "shard_specs"]


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How one tensor of a module is split: along ``axis`` into ``world_size`` equal parts, part ``rank``."""

    axis: int
    world_size: int
    rank: int
    full_shape: Tuple[int, ...]

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's part of the unsharded tensor ``full``."""
        size = full.shape[self.axis] // self.world_size
        return full.narrow(self.axis, self.rank * size, size)


@dataclasses.dataclass
class ShardSource:
    source: "weakref.ReferenceType[torch.Tensor]"
    spec: ShardSpec


# keyed by tensor identity (tensors compare elementwise, so an ordinary weak dict cannot hold them)
_SOURCES = WeakIdKeyDictionary()


def shard_tensor(t: torch.Tensor, axis: int, rank: int, world_size: int) -> torch.Tensor:
    """A fresh (non-aliasing) copy of this rank's slice of ``t`` along ``axis``."""
    size = t.shape[axis] // world_size
    return t.detach().narrow(axis, rank * size, size).clone()


def record_shard_source(shard: torch.Tensor, source: torch.Tensor, spec: ShardSpec) -> None:
    prior = _SOURCES.get(source)
    if prior is not None and prior.source() is not None:
        # a shard of a shard: remember the original tensor and compose the slicing
        outer = prior.spec
        if outer.axis == spec.axis:
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
    """The shard records of ``module``'s own tensors (name -> spec)."""
    return dict(getattr(module, "_schedlang_shards", {}))

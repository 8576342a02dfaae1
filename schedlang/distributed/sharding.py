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
from ..shard_spec import ShardSpec  # noqa: F401  (also importable from here, where it used to live)

__all__ = ["ShardSpec", "ShardSource", "shard_tensor", "shard_source", "record_shard_source", "shard_specs",
           "remember_unsharded", "unsharded_view"]


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

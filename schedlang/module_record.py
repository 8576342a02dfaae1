"""One record per module of what the schedule did to it.

Every fact a primitive leaves on a module that later code must read (which of its tensors
were split and how, the sync points it runs, the class and attributes it had before a shard
rule changed them, whether it is checkpointed or a fused kernel, its parameters' annotations) lives in one
:class:`ModuleRecord`, stored under one attribute of the module (:data:`RECORD_ATTR`). Build,
Verify, checkpointing, the report, the tracer and the graph passes all read it through the
functions below; nothing else on a module carries schedule facts.

The record is plain, immutable data:

* it survives ``copy.deepcopy`` (a replayed or verified copy carries it);
* it is never changed in place: every change assigns a new record, so undoing a failed step
  (which restores each module's attribute dictionary) restores the record exactly;
* it moves with the module when a primitive puts another module in its place
  (:func:`copy_module_as`, the tracer's attribute carry-over). No module's class is ever changed in
  place: ``decompose`` and the shard rules that need another class (a row-parallel linear adds its
  bias after the all-reduce, a vocabulary-parallel embedding masks its lookup) install a new
  instance holding the same parameters, children, hooks and record, and the record keeps the
  class the module had before a shard rule replaced it.

Process groups are not data and cannot be copied, so a sync's collective runs in its
:class:`~schedlang.distributed.sync_ops.SyncOp` child; the record names that child
(:class:`SyncSpec`) and says in which order and where the module's syncs run.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

from torch import nn

from .shard_spec import ShardSpec

__all__ = ["ModuleRecord", "SyncSpec", "RECORD_ATTR", "module_record", "has_record", "update_record", "shard_specs",
           "record_shard", "expert_slice_specs", "record_expert_slice", "record_sync", "sync_specs", "remember_original", "original_view",
           "copy_module_as"]

#: the one attribute of a module that holds its record
RECORD_ATTR = "_schedlang_record"


@dataclasses.dataclass(frozen=True)
class SyncSpec:
    """One sync point of a module: where it acts (``mode``), which collective (``op``, a name or a
    callable, with ``axis`` for all_gather / reduce_scatter) and the child that runs it (``child``)."""

    mode: str
    op: Union[str, Callable[..., Any]]
    child: str
    axis: Optional[int] = None

    def describe(self) -> str:
        op = getattr(self.op, "__qualname__", repr(self.op)) if callable(self.op) else self.op
        return f"{self.mode} {op}" + ("" if self.axis is None else f" (axis {self.axis})")


@dataclasses.dataclass(frozen=True)
class ModuleRecord:
    """What the schedule did to one module.

    * ``shards``: name of an own parameter or buffer -> its ``ShardSpec`` (``shard``);
    * ``syncs``: the module's sync points in the order they were added (``sync``);
    * ``syncs_before_bias``: the module's own forward runs its ``fwd_post`` syncs, before adding
      its bias (a row-parallel linear adds the bias once, after the all-reduce), instead of the
      forward hook running them after the forward;
    * ``original_class`` / ``original_attributes``: the class the module had before a shard rule
      replaced it by an instance of another class (:func:`copy_module_as` with ``remember_class``),
      and the attributes it had before a shard rule changed them (None / empty: unchanged);
      ``build`` initializes a meta-device module at full size from them;
    * ``checkpointed`` / ``checkpoint_options``: the forward runs under activation checkpointing;
    * ``fused``: the module is a kernel made by ``fuse`` (opaque to tracing and pattern search);
    * ``annotations``: parameter name -> ``{key: value}`` set by ``annotate`` (``build`` sets them again
      on the parameters it makes);
    * ``expert_slices``: name of an own parameter -> the ``ShardSpec`` of the experts (along dim 0) that this
      rank holds under expert parallelism (``expert_parallel``); unlike ``shards`` the slice is over the
      expert-parallel group, not the tensor-parallel one, and stays a plain tensor at build. ``build``
      initializes the full tensor and keeps the slice; checkpoints and export gather it back.
    """

    shards: Mapping[str, "ShardSpec"] = dataclasses.field(default_factory=dict)
    syncs: Tuple[SyncSpec, ...] = ()
    syncs_before_bias: bool = False
    original_class: Optional[type] = None
    original_attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    checkpointed: bool = False
    checkpoint_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fused: bool = False
    annotations: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    expert_slices: Mapping[str, "ShardSpec"] = dataclasses.field(default_factory=dict)

    def is_empty(self) -> bool:
        return self == ModuleRecord()


_EMPTY = ModuleRecord()


def module_record(module: nn.Module) -> ModuleRecord:
    """``module``'s record (an empty one when the schedule did nothing to it). Read it, never change it:
    use :func:`update_record`."""
    record = module.__dict__.get(RECORD_ATTR)
    return record if isinstance(record, ModuleRecord) else _EMPTY


def has_record(module: nn.Module) -> bool:
    return not module_record(module).is_empty()


def update_record(module: nn.Module, **changes: Any) -> ModuleRecord:
    """Give ``module`` a new record: its current one with ``changes``. Never mutates the old record, so a
    failed step's undo (which restores the module's attribute dictionary) brings the old one back."""
    record = dataclasses.replace(module_record(module), **changes)
    module.__dict__[RECORD_ATTR] = record
    return record


# --------------------------------------------------------------------------- shards

def shard_specs(module: nn.Module) -> Dict[str, "ShardSpec"]:
    """The shard records of ``module``'s own tensors (name -> spec)."""
    return dict(module_record(module).shards)


def record_shard(module: nn.Module, name: str, spec: "ShardSpec") -> None:
    """Record that ``module``'s tensor ``name`` is now the shard ``spec`` describes."""
    update_record(module, shards={**module_record(module).shards, name: spec})


def expert_slice_specs(module: nn.Module) -> Dict[str, "ShardSpec"]:
    """The expert-parallel slices of ``module``'s own tensors (name -> spec along dim 0)."""
    return dict(module_record(module).expert_slices)


def record_expert_slice(module: nn.Module, name: str, spec: "ShardSpec") -> None:
    """Record that ``module``'s tensor ``name`` is this rank's slice of experts ``spec`` describes."""
    update_record(module, expert_slices={**module_record(module).expert_slices, name: spec})


# --------------------------------------------------------------------------- syncs

def record_sync(module: nn.Module, spec: SyncSpec) -> None:
    """Add ``spec`` to the sync points ``module`` runs (after the ones it has)."""
    update_record(module, syncs=module_record(module).syncs + (spec,))


def sync_specs(module: nn.Module, *modes: str) -> Tuple[SyncSpec, ...]:
    """``module``'s sync points (of the given modes, all when none is given), in the order they were added."""
    syncs = module_record(module).syncs
    return tuple(s for s in syncs if not modes or s.mode in modes)


# --------------------------------------------------------------------------- original class and attributes

def remember_original(module: nn.Module, **attributes: Any) -> None:
    """Record the given attributes of ``module`` as they were before any shard changed them.

    The first record of an attribute wins, so a second shard keeps the original value.
    """
    record = module_record(module)
    update_record(module, original_attributes={**attributes, **record.original_attributes})


def original_view(module: nn.Module) -> Tuple[type, Dict[str, Any]]:
    """``(class, attributes)`` of ``module`` before the schedule changed them (its current class and no
    attributes when it was never changed)."""
    record = module_record(module)
    return record.original_class or type(module), dict(record.original_attributes)


# --------------------------------------------------------------------------- replacement

def copy_module_as(module: nn.Module, new_class: type, *, remember_class: bool = False) -> nn.Module:
    """A new ``new_class`` instance standing in for ``module``: the same ``Parameter`` and buffer objects,
    the same children, copies of its hook tables and its record; ``module`` itself is left unchanged.

    Attributes are copied shallowly (one new dictionary per table), so nothing is shared that a later
    step could change for both. An instance-level forward bound to ``module`` (activation
    checkpointing) is bound to the new module instead.

    With ``remember_class`` the new module's record keeps ``module``'s class as its original class
    (unless an earlier change recorded one already): a shard rule's replacement (a row-parallel
    linear, a vocabulary-parallel embedding) is initialized by ``build`` on the meta device as the
    unsharded class would be. schedlang never assigns ``__class__``; the caller installs the new
    module wherever the model held the old one, and undoing the step puts the old one back.
    """
    new = new_class.__new__(new_class)
    for key, value in module.__dict__.items():
        if isinstance(value, dict):
            value = type(value)(value) if type(value) is not dict else dict(value)
        elif isinstance(value, types.MethodType) and value.__self__ is module:
            value = types.MethodType(value.__func__, new)
        new.__dict__[key] = value
    if remember_class and module_record(new).original_class is None:
        update_record(new, original_class=type(module))
    return new

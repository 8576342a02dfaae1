"""``shard(tensor_name, axis)``: split a parameter or buffer over the schedule's process group.

Every rank keeps an equal slice along ``axis`` (rank r holds part r). The module's shard
rule (see :mod:`schedlang.distributed.shard_rules`) refuses splits that cannot work and
keeps the module consistent afterwards. The new tensor is a fresh ``Parameter``; the
unsharded one is left untouched.

Two things beyond the module itself are taken care of:

* tied tensors: when the same ``Parameter`` is held by several modules of the model (an
  LM head tied to the word embeddings), every holder gets the same new shard, so the tie
  survives (each holder's rule checks and fixes up its module);
* the parent's rule: a module whose behaviour depends on its children's shapes (an
  attention module's head count, GPT-2's fused q|k|v projection) may check the split
  (``check_child_shard``, which may ask for a fused layout: ``groups`` equal blocks split
  block-wise) and update itself afterwards (``after_child_shard``);
* another class: a rule whose module needs another ``forward`` once split (a row-parallel
  ``nn.Linear`` adds its bias after the all-reduce) names it (``replacement_class``); a new
  instance holding the same parameters, buffers, children, hooks and record (which keeps the
  original class, for ``build``) takes the old module's place at every path of the model, before
  the rule's ``after_shard`` and the parent's ``after_child_shard`` run on it. The old object
  keeps its class; undoing a failed step puts it back at its paths.
"""

from __future__ import annotations

import logging

from torch import nn

from ..distributed.shard_rules import find_shard_rule
from ..distributed.sharding import ShardSpec, record_shard_source, shard_tensor
from ..errors import ScheduleKeyError, ShardError
from ..module_record import copy_module_as, record_shard, shard_specs
from .base import Param, Primitive, install_in_place_of, register_primitive

logger = logging.getLogger("schedlang.primitives.shard")


def _tensor_names(module: nn.Module):
    return [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]


@register_primitive
class Shard(Primitive):
    """Split parameter or buffer ``tensor_name`` of this module along ``axis`` over the group.

    Example (a Megatron MLP)::

        sch["fc1"].shard("weight", axis=0); sch["fc1"].shard("bias", axis=0)
        sch["fc2"].shard("weight", axis=1)
    """

    name = "shard"
    params = (
        Param("tensor_name", str, doc="a parameter or buffer of this module",
              type_error="{where}: shard expects a tensor name (str), got {value}"),
        Param("axis", int, doc="the dimension to split (negative counts from the end)"),
    )

    @classmethod
    def validate(cls, sch, tensor_name, axis):
        module, where = sch.mod, sch.path or "<root>"
        names = _tensor_names(module)
        if tensor_name not in names:
            raise ScheduleKeyError(
                f"{where}: {type(module).__name__} has no parameter or buffer '{tensor_name}'; "
                f"valid names: {', '.join(names) if names else 'none (it owns no tensors)'}")
        tensor = getattr(module, tensor_name)
        shape = tuple(tensor.shape)
        ndim = len(shape)
        if not -ndim <= axis < ndim:
            valid = ", ".join(str(a) for a in range(ndim)) if ndim else "none (a 0-d tensor cannot be sharded)"
            raise ShardError(
                f"{where}: cannot shard '{tensor_name}' (shape {shape}) along axis {axis}: valid axes are {valid}")
        axis = axis % ndim
        world = sch.world_size
        if _sharded_through_tie(sch, tensor_name, axis):
            logger.info("%s: '%s' is tied to another module's tensor and was sharded with it along axis %d; "
                        "nothing to do", where, tensor_name, axis)
            return {"tensor_name": tensor_name, "axis": axis}
        if shape[axis] % world:
            raise ShardError(
                f"{where}: cannot shard '{tensor_name}' (shape {shape}) along axis {axis}: size {shape[axis]} is not "
                f"divisible by the world size {world}")
        _check_holders(sch, tensor, axis, world)
        return {"tensor_name": tensor_name, "axis": axis}

    @classmethod
    def apply(cls, sch, tensor_name, axis):
        module = sch.mod
        if _sharded_through_tie(sch, tensor_name, axis):
            return None  # sharded already, together with the module it is tied to
        world, rank = sch.world_size, sch.rank
        old = getattr(module, tensor_name)
        holders = _holders(sch, old)
        layout = _check_holders(sch, old, axis, world, holders)
        groups, blocks = (len(layout), layout) if isinstance(layout, tuple) else (layout, None)
        spec = ShardSpec(axis=axis, world_size=world, rank=rank, full_shape=tuple(old.shape), groups=groups,
                         blocks=blocks)
        piece = shard_tensor(old, axis, rank, world, groups, blocks)
        is_param = tensor_name in module._parameters
        new = nn.Parameter(piece, requires_grad=old.requires_grad) if is_param else piece
        record_shard_source(new, old, spec)
        for path, holder, name in holders:
            (holder._parameters if is_param else holder._buffers)[name] = new
            record_shard(holder, name, spec)
        # each distinct holder is fixed up once; the module now in its place (itself, or the replacement its
        # rule asked for) is what its parent's rule and every later step see
        now_in_place = {}
        for path, holder, name in holders:
            if id(holder) not in now_in_place:
                now_in_place[id(holder)] = _fix_up(sch, holder, name, axis, world, rank)
            current = now_in_place[id(holder)]
            parent, child_name = _parent(sch, path)
            parent_rule = find_shard_rule(parent) if parent is not None else None
            if parent_rule is not None and hasattr(parent_rule, "after_child_shard"):
                parent_rule.after_child_shard(parent, child_name, current, name, axis, world, rank)
        return None


def _fix_up(sch, holder, name, axis, world, rank):
    """Run ``holder``'s rule after its tensor ``name`` became a shard: put the replacement it asks for in
    its place (everywhere the model holds it), then let the rule update that module. Returns the module
    now in ``holder``'s place."""
    rule = find_shard_rule(holder)
    if rule is None:
        return holder
    ask = getattr(rule, "replacement_class", None)
    klass = ask(holder, name, axis, world, rank) if ask is not None else None
    current = holder
    if klass is not None and klass is not type(holder):
        current = copy_module_as(holder, klass, remember_class=True)
        install_in_place_of(sch, holder, current)
    rule.after_shard(current, name, axis, world, rank)
    return current


def _sharded_through_tie(sch, tensor_name, axis) -> bool:
    """Whether ``tensor_name`` is a tied tensor (held by several modules) already sharded along ``axis``:
    sharding one holder shards every holder, so a script that then shards each holder too (as Slapo's
    do) asks for what is already done. Sharding a tensor only this module holds twice stays an error."""
    prior = shard_specs(sch.mod).get(tensor_name)
    return prior is not None and prior.axis == axis and len(_holders(sch, getattr(sch.mod, tensor_name))) > 1


def _holders(sch, tensor):
    """(path, module, name) of every module of the model that holds ``tensor`` (tied weights), this one first."""
    own = sch.mod
    found = [(sch.path, own, n) for n, t in list(own._parameters.items()) + list(own._buffers.items())
             if t is tensor]
    seen = {(p, n) for p, _, n in found}
    for path, m in sch._walk():
        if m is own:
            continue
        for store in (m._parameters, m._buffers):
            for n, t in store.items():
                if t is tensor and (path, n) not in seen:
                    found.append((path, m, n))
                    seen.add((path, n))
    return found


def _parent(sch, path):
    if not path:
        return None, ""
    parent_path, _, child_name = path.rpartition(".")
    return sch.root[parent_path].mod, child_name


def _check_holders(sch, tensor, axis, world, holders=None):
    """Run every holder's rule and its parent's rule; return the layout they agree on: a number of equal
    blocks (``groups``), or a tuple of the sizes of unequal blocks (``blocks``)."""
    groups_by = {}
    shape = tuple(tensor.shape)
    for path, holder, name in (holders if holders is not None else _holders(sch, tensor)):
        where = path or "<root>"
        prior = shard_specs(holder).get(name)
        if prior is not None:
            raise ShardError(f"{where}: '{name}' is already sharded (along axis {prior.axis}); a tensor can be "
                             "sharded only once")
        rule = find_shard_rule(holder)
        if rule is not None:
            rule.check(path, holder, name, axis, world)
        else:
            logger.info("%s: no shard rule for %s; '%s' is split and the module is left as it is",
                        where, type(holder).__name__, name)
        parent, child_name = _parent(sch, path)
        parent_rule = find_shard_rule(parent) if parent is not None else None
        groups = 1
        if parent_rule is not None and hasattr(parent_rule, "check_child_shard"):
            groups = parent_rule.check_child_shard(path, parent, child_name, holder, name, axis, world) or 1
        groups_by[where] = groups
    if len(set(groups_by.values())) > 1:
        shown = ", ".join(f"{p}: {g}" for p, g in groups_by.items())
        raise ShardError(f"{sch.path or '<root>'}: the tied tensor's holders need different fused layouts ({shown}); "
                         "shard them separately or untie them")
    groups = next(iter(groups_by.values()))
    if isinstance(groups, tuple):
        if sum(groups) != shape[axis] or any(b % world for b in groups):
            raise ShardError(f"{sch.path or '<root>'}: cannot shard the fused tensor (shape {shape}, blocks of "
                             f"{', '.join(map(str, groups))} along axis {axis}) over {world} ranks: the blocks must "
                             f"add up to {shape[axis]} and each be divisible by {world}")
        return groups
    if shape[axis] % (world * groups):
        raise ShardError(f"{sch.path or '<root>'}: cannot shard the fused tensor (shape {shape}, {groups} blocks along "
                         f"axis {axis}) over {world} ranks: each block of {shape[axis] // groups} must be divisible "
                         f"by {world}")
    return groups

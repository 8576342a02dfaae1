"""``shard(tensor_name, axis)``: split a parameter or buffer over the schedule's process group.

Every rank keeps an equal slice along ``axis`` (rank r holds part r). The module's shard
rule (see :mod:`schedlang.distributed.shard_rules`) refuses splits that cannot work and
keeps the module consistent afterwards. The new tensor is a fresh ``Parameter``; the
unsharded one is left untouched for whoever else holds it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..distributed.shard_rules import find_shard_rule
from ..distributed.sharding import ShardSpec, record_shard_source, shard_tensor
from ..errors import ScheduleKeyError, ScheduleTypeError, ShardError
from .base import Primitive, register_primitive

logger = logging.getLogger("schedlang.primitives.shard")


def _tensor_names(module: nn.Module):
    return [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]


@register_primitive
class Shard(Primitive):
    name = "shard"

    @classmethod
    def validate(cls, sch, tensor_name, axis):
        module, where = sch.mod, sch.path or "<root>"
        if not isinstance(tensor_name, str):
            raise ScheduleTypeError(f"{where}: shard expects a tensor name (str), got {tensor_name!r}")
        names = _tensor_names(module)
        if tensor_name not in names:
            raise ScheduleKeyError(
                f"{where}: {type(module).__name__} has no parameter or buffer '{tensor_name}'; "
                f"valid names: {', '.join(names) if names else 'none (it owns no tensors)'}")
        tensor = getattr(module, tensor_name)
        shape = tuple(tensor.shape)
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ScheduleTypeError(f"{where}: shard axis must be an int, got {axis!r}")
        ndim = len(shape)
        if not -ndim <= axis < ndim:
            valid = ", ".join(str(a) for a in range(ndim)) if ndim else "none (a 0-d tensor cannot be sharded)"
            raise ShardError(
                f"{where}: cannot shard '{tensor_name}' (shape {shape}) along axis {axis}: valid axes are {valid}")
        axis = axis % ndim
        world = sch.world_size
        if shape[axis] % world:
            raise ShardError(
                f"{where}: cannot shard '{tensor_name}' (shape {shape}) along axis {axis}: size {shape[axis]} is not "
                f"divisible by the world size {world}")
        if tensor_name in getattr(module, "_schedlang_shards", {}):
            prior = module._schedlang_shards[tensor_name]
            raise ShardError(f"{where}: '{tensor_name}' is already sharded (along axis {prior.axis}); a tensor is "
                             "sharded once")
        rule = find_shard_rule(module)
        if rule is not None:
            rule.check(sch.path, module, tensor_name, axis, world)
        else:
            logger.info("%s: no shard rule for %s; '%s' is split and the module is left as it is",
                        where, type(module).__name__, tensor_name)
        return {"tensor_name": tensor_name, "axis": axis}

    @classmethod
    def apply(cls, sch, tensor_name, axis):
        module = sch.mod
        world, rank = sch.world_size, sch.rank
        old = getattr(module, tensor_name)
        spec = ShardSpec(axis=axis, world_size=world, rank=rank, full_shape=tuple(old.shape))
        piece = shard_tensor(old, axis, rank, world)
        if tensor_name in module._parameters:
            new = nn.Parameter(piece, requires_grad=old.requires_grad)
            module._parameters[tensor_name] = new
        else:
            new = piece
            module._buffers[tensor_name] = new
        record_shard_source(new, old, spec)
        module._schedlang_shards = {**getattr(module, "_schedlang_shards", {}), tensor_name: spec}
        rule = find_shard_rule(module)
        if rule is not None:
            rule.after_shard(module, tensor_name, axis, world, rank)
        sch.metadata.setdefault("shards", {})[tensor_name] = spec
        return None

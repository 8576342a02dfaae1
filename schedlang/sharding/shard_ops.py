"""What sharding a parameter means for its module, per module type (Slapo's ``ShardMethod``s).

``Schedule.shard`` applies schedlang's own shard rules (:mod:`schedlang.distributed.shard_rules`);
the classes here answer the questions Slapo-style code asks about a shard, and let such code
register its own module types:

* ``infer_output_type(sch, param_name, sharded_size, axis)``: ``("partition", axis)`` when each
  rank computes a slice of the output (to gather along ``axis``, counted from the end), ``("partial",
  None)`` when each computes a partial sum (to all-reduce), ``(None, None)`` when unknown;
* ``postproc``: the module attributes that follow the shard (``out_features`` ...);
* ``sync``: inserting a collective, which is ``Schedule.sync``.

Example::

    method = dispatch_shard_method_cls(sch["fc1"])
    method.infer_output_type(sch["fc1"], "weight", 64, axis=0)   # ("partition", -1)
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from torch import nn

from ..errors import ScheduleTypeError, ScheduleValueError, ShardError

__all__ = ["ShardMethod", "ShardLinear", "ShardConv2d", "ShardConv1D", "ShardBatchNorm2d", "register_shard_method",
           "dispatch_shard_method_cls", "apply_shard_method", "apply_sync_method", "new_or_get_tied_param",
           "SHARD_METHODS"]

SHARD_METHODS: Dict[type, type] = {}


def register_shard_method(module_cls: Optional[type]):
    """Class decorator: ``method_cls`` (a :class:`ShardMethod` subclass) describes ``module_cls``.
    A ``module_cls`` of None (an optional dependency that is missing) registers nothing."""

    def decorator(method_cls):
        if module_cls is None:
            return method_cls
        if not (isinstance(method_cls, type) and issubclass(method_cls, ShardMethod)):
            raise ScheduleTypeError(f"register_shard_method({module_cls.__name__}): {method_cls!r} is not a "
                                    "ShardMethod subclass")
        if module_cls in SHARD_METHODS:
            raise ScheduleValueError(f"register_shard_method: {module_cls.__name__} already has "
                                     f"{SHARD_METHODS[module_cls].__name__}")
        SHARD_METHODS[module_cls] = method_cls
        return method_cls

    return decorator


def dispatch_shard_method_cls(sch) -> type:
    """The :class:`ShardMethod` of ``sch.mod``'s type (subclasses included; the default otherwise)."""
    for module_cls in type(sch.mod).__mro__:
        if module_cls in SHARD_METHODS:
            return SHARD_METHODS[module_cls]
    return ShardMethod


def apply_shard_method(method_type: str, sch, param_name: str, sharded_size: int, axis: int):
    """Call ``method_type`` (``preproc``, ``postproc`` or ``infer_output_type``) of ``sch.mod``'s method."""
    if method_type not in ("preproc", "postproc", "infer_output_type"):
        raise ScheduleValueError(f"apply_shard_method: unknown method {method_type!r}: valid are preproc, "
                                 "postproc, infer_output_type")
    return getattr(dispatch_shard_method_cls(sch), method_type)(sch, param_name, sharded_size, axis)


def apply_sync_method(sch, mode: str, sync_op_or_fn, **kwargs):
    """Insert a synchronization at ``sch`` (the ``sync`` primitive, recorded in the plan)."""
    return dispatch_shard_method_cls(sch).sync(sch, mode, sync_op_or_fn, **kwargs)


def new_or_get_tied_param(sch, old_param: nn.Parameter, new_tensor):
    """A parameter holding ``new_tensor`` to replace ``old_param``; if ``old_param`` was tied to a
    parameter already replaced this way, that same replacement (so the tie holds)."""
    ties = sch.root.metadata.setdefault("tie_weights", {})
    done = ties.get(id(old_param))
    if done is not None:
        if tuple(done.shape) != tuple(new_tensor.shape):
            raise ShardError(f"{sch.path or '<root>'}: a tied parameter was already sharded to shape "
                             f"{tuple(done.shape)}, but this shard has shape {tuple(new_tensor.shape)}; both "
                             "holders of a tied parameter must be sharded the same way")
        return done
    new_param = nn.Parameter(new_tensor, requires_grad=old_param.requires_grad)
    ties[id(old_param)] = new_param
    return new_param


class ShardMethod:
    """Defaults: nothing to fix, output type unknown, ``sync`` is ``Schedule.sync``."""

    @staticmethod
    def preproc(sch, param_name: str, sharded_size: int, axis: int) -> None:
        return None

    @staticmethod
    def postproc(sch, param_name: str, sharded_size: int, axis: int) -> None:
        return None

    @staticmethod
    def infer_output_type(sch, param_name: str, sharded_size: int, axis: int) -> Tuple[Optional[str], Optional[int]]:
        return None, None

    @staticmethod
    def sync(sch, mode: str, sync_op_or_fn, **kwargs):
        return sch.sync(mode=mode, sync_op_or_fn=sync_op_or_fn, **kwargs)


@register_shard_method(nn.Linear)
class ShardLinear(ShardMethod):
    """``weight`` (out, in): axis 0 splits the outputs (column parallel), axis 1 the inputs (row parallel)."""

    @staticmethod
    def postproc(sch, param_name, sharded_size, axis):
        if axis == 0:
            sch.mod.out_features = sharded_size
        elif param_name == "weight":
            sch.mod.in_features = sharded_size

    @staticmethod
    def infer_output_type(sch, param_name, sharded_size, axis):
        return ("partition", -1) if axis == 0 else ("partial", None)


@register_shard_method(nn.Conv2d)
class ShardConv2d(ShardMethod):
    """``weight`` (out_channels, in_channels, kh, kw) (swapped when transposed)."""

    @staticmethod
    def _axes(sch):
        return (1, 0) if sch.mod.transposed else (0, 1)

    @staticmethod
    def postproc(sch, param_name, sharded_size, axis):
        out_axis, in_axis = ShardConv2d._axes(sch)
        if axis == out_axis:
            sch.mod.out_channels = sharded_size
        elif axis == in_axis and param_name == "weight":
            sch.mod.in_channels = sharded_size

    @staticmethod
    def infer_output_type(sch, param_name, sharded_size, axis):
        out_axis, in_axis = ShardConv2d._axes(sch)
        if axis == out_axis or param_name == "bias":
            return "partition", 1
        if axis == in_axis:
            return "partial", None
        raise ShardError(f"{sch.path or '<root>'}: a Conv2d shards only along its channel axes {out_axis} or "
                         f"{in_axis}, "
                         f"not {axis}")


def _hf_conv1d():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is optional
        return None
    return Conv1D


@register_shard_method(_hf_conv1d())
class ShardConv1D(ShardMethod):
    """HF ``Conv1D``: ``weight`` (in, out), the transpose of a Linear's."""

    @staticmethod
    def postproc(sch, param_name, sharded_size, axis):
        if axis == 1 or param_name == "bias":
            sch.mod.nf = sharded_size

    @staticmethod
    def infer_output_type(sch, param_name, sharded_size, axis):
        return ("partition", -1) if axis == 1 or param_name == "bias" else ("partial", None)


@register_shard_method(nn.BatchNorm2d)
class ShardBatchNorm2d(ShardMethod):
    """Per-channel parameters: only axis 0 (the channels)."""

    @staticmethod
    def postproc(sch, param_name, sharded_size, axis):
        if axis != 0:
            raise ShardError(f"{sch.path or '<root>'}: BatchNorm2d shards along axis 0 (channels) only, got {axis}")
        sch.mod.num_features = sharded_size

    @staticmethod
    def infer_output_type(sch, param_name, sharded_size, axis):
        if axis != 0:
            raise ShardError(f"{sch.path or '<root>'}: BatchNorm2d shards along axis 0 (channels) only, got {axis}")
        return "partition", 1

"""``sync(mode, sync_op_or_fn, **kw)``: insert a collective at a module boundary.

``mode`` says where: ``fwd_pre`` (on the input, in forward), ``fwd_post`` (on the output, in
forward) or ``bwd_post`` (on the input's gradient, after the module's backward). The op is
``all_reduce``, ``all_gather`` or ``reduce_scatter`` (the last two take ``axis=``), or any
callable ``fn(tensor) -> tensor``. Collectives are autograd-aware (see
:mod:`schedlang.distributed.collectives`), so gradients stay exact.

Keyword options: ``axis`` (all_gather / reduce_scatter), ``tensor_parallel_output_grad``
(all_gather in forward: True when the consumer is replicated so the gradient only needs
slicing, False when each rank holds a partial gradient that must be reduce-scattered).
"""

from __future__ import annotations

from ..distributed.sync_ops import SYNC_MODES, SYNC_OPS, SyncOp, attach_sync
from ..errors import SyncError
from .base import Primitive, encode_value, register_primitive

_OPTIONS = ("axis", "tensor_parallel_output_grad")


@register_primitive
class Sync(Primitive):
    name = "sync"

    @classmethod
    def validate(cls, sch, mode, sync_op_or_fn="all_reduce", **kwargs):
        where = sch.path or "<root>"
        if mode not in SYNC_MODES:
            raise SyncError(f"{where}: invalid sync mode {mode!r}: valid modes are {', '.join(SYNC_MODES)}")
        if not callable(sync_op_or_fn) and sync_op_or_fn not in SYNC_OPS:
            raise SyncError(f"{where}: invalid sync op {sync_op_or_fn!r}: valid ops are {', '.join(SYNC_OPS)}, "
                            "or a callable fn(tensor) -> tensor")
        unknown = sorted(set(kwargs) - set(_OPTIONS))
        if unknown:
            raise SyncError(f"{where}: unknown sync option(s) {', '.join(unknown)}: valid options are "
                            f"{', '.join(_OPTIONS)}")
        axis = kwargs.get("axis")
        if sync_op_or_fn in ("all_gather", "reduce_scatter"):
            if axis is None:
                raise SyncError(f"{where}: sync op {sync_op_or_fn!r} needs axis=<int> (the dimension to "
                                f"{'gather' if sync_op_or_fn == 'all_gather' else 'scatter'} along)")
            if isinstance(axis, bool) or not isinstance(axis, int):
                raise SyncError(f"{where}: sync axis must be an int, got {axis!r}")
        elif axis is not None:
            raise SyncError(f"{where}: sync op {sync_op_or_fn!r} takes no axis (got axis={axis!r}); only all_gather "
                            "and reduce_scatter do")
        grad_replicated = kwargs.get("tensor_parallel_output_grad", True)
        if not isinstance(grad_replicated, bool):
            raise SyncError(f"{where}: tensor_parallel_output_grad must be True or False, got {grad_replicated!r}")
        args = {"mode": mode, "sync_op_or_fn": sync_op_or_fn}
        if axis is not None:
            args["axis"] = axis
        if "tensor_parallel_output_grad" in kwargs:
            args["tensor_parallel_output_grad"] = grad_replicated
        return args

    @classmethod
    def apply(cls, sch, mode, sync_op_or_fn, axis=None, tensor_parallel_output_grad=True):
        op = SyncOp(mode, sync_op_or_fn, axis=axis, group=sch.group, grad_is_replicated=tensor_parallel_output_grad)
        name = attach_sync(sch.mod, op)
        sch.metadata.setdefault("syncs", []).append(name)
        return None

    @classmethod
    def encode_args(cls, args, step_index, path):
        where = f"step {step_index} (sync at '{path or '<root>'}'), argument 'sync_op_or_fn'"
        out = dict(args)
        out["sync_op_or_fn"] = encode_value(args["sync_op_or_fn"], where)
        return out

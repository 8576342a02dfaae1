"""``sync(mode, sync_op_or_fn, **options)``: insert a collective at a module boundary.

``mode`` says where: ``fwd_pre`` (on the input, in forward), ``fwd_post`` (on the output, in
forward) or ``bwd_post`` (on the input's gradient, after the module's backward). The op is
``all_reduce``, ``all_gather`` or ``reduce_scatter`` (the last two take ``axis=``), one of Slapo's
resharding schemes of an activation (``"RS->SR"`` ...: :data:`~schedlang.distributed.sync_ops.RESHARD_SCHEMES`),
any callable ``fn(tensor) -> tensor``, or a Slapo hook ``fn(module, input)`` at ``fwd_pre`` /
``fn(module, input, output)`` at ``fwd_post`` (called as PyTorch calls forward hooks). Collectives are autograd-aware (see
:mod:`schedlang.distributed.collectives`), so gradients stay exact.

Keyword options: ``axis`` (all_gather / reduce_scatter), ``tensor_parallel_output_grad``
(all_gather in forward, Slapo's and Megatron's meaning: True (the default) when the consumer is
tensor parallel, so each rank holds a partial gradient that the backward reduce-scatters; False
when the consumer is replicated (a loss, a gathered logit), so the gradient is only sliced).

An ``axis`` is checked against the rank of the tensor it applies to: at call time when the
module sits in a transformers model (one run of that model on fake tensors tells the rank of
every module's input and output), and otherwise at the first forward, before any collective.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

from ..distributed.collectives import check_even_split
from ..distributed.groups import world_size
from ..distributed.sync_ops import RESHARD_SCHEMES, SYNC_MODES, SYNC_OPS, SyncOp, attach_sync, hook_style
from ..errors import SyncError
from ..module_record import sync_specs
from .base import Param, Primitive, register_primitive

logger = logging.getLogger("schedlang.primitives.sync")

#: steps after which every module's input and output keep their rank, so a probe stays valid
_RANK_PRESERVING = frozenset({"shard", "sync", "annotate", "fork_rng", "checkpoint", "decompose", "fully_shard",
                              "replicate", "cut_pipeline_stage"})
#: per schedule state: (which model was probed, plan length then, {path: (input rank, output rank)})
_PROBES: "weakref.WeakKeyDictionary[Any, Tuple[Any, int, Dict[str, Tuple[Optional[int], Optional[int]]]]]" = \
    weakref.WeakKeyDictionary()


@register_primitive
class Sync(Primitive):
    """Insert a synchronization: ``mode`` in ``fwd_pre``, ``fwd_post``, ``bwd_post``;
    op ``all_reduce``, ``all_gather`` (``axis=``), ``reduce_scatter`` (``axis=``) or a callable.

    Example::

        sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        sch["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    """

    name = "sync"
    argument_error = SyncError
    params = (
        Param("mode", str, doc="where: 'fwd_pre', 'fwd_post' or 'bwd_post'",
              valid=lambda: f"valid modes are {', '.join(SYNC_MODES)}"),
        Param("sync_op_or_fn", Union[str, Callable[..., Any]], "all_reduce",
              "'all_reduce', 'all_gather', 'reduce_scatter' or a callable fn(tensor) -> tensor"),
        Param("axis", int, None, "the dimension all_gather / reduce_scatter work along", option=True),
        Param("tensor_parallel_output_grad", bool, True,
              "all_gather in forward: the consumer holds partial gradients (True: reduce-scatter them) or is "
              "replicated (False: slice the gradient)",
              option=True),
    )

    @classmethod
    def validate(cls, sch, mode, sync_op_or_fn="all_reduce", **options):
        where = sch.path or "<root>"
        if mode not in SYNC_MODES:
            raise SyncError(f"{where}: invalid sync mode {mode!r}: valid modes are {', '.join(SYNC_MODES)}")
        if not callable(sync_op_or_fn) and sync_op_or_fn not in SYNC_OPS and sync_op_or_fn not in RESHARD_SCHEMES:
            raise SyncError(f"{where}: invalid sync op {sync_op_or_fn!r}: valid ops are {', '.join(SYNC_OPS)}, "
                            f"a resharding scheme ({', '.join(RESHARD_SCHEMES)}), or a callable fn(tensor) -> tensor")
        if isinstance(sync_op_or_fn, type):
            # a class is callable, but calling it on the tensor would make an object, not the synced tensor
            raise SyncError(f"{where}: sync got the class {sync_op_or_fn.__name__} as its function; pass an instance "
                            f"({sync_op_or_fn.__name__}(...)) or a function fn(tensor) -> tensor, or one of the ops "
                            f"{', '.join(SYNC_OPS)}")
        if callable(sync_op_or_fn) and not hook_style(sync_op_or_fn, mode):
            problem = _cannot_take_one_tensor(sync_op_or_fn)
            if problem:
                name = getattr(sync_op_or_fn, "__name__", type(sync_op_or_fn).__name__)
                hook = {"fwd_pre": ", or a hook fn(module, input)", "fwd_post": ", or a hook fn(module, input, "
                        "output)"}.get(mode, "")
                raise SyncError(f"{where}: sync function {name} cannot be called with one tensor "
                                f"({problem}); give a function fn(tensor) -> tensor{hook}")
        axis = options.get("axis")
        if isinstance(sync_op_or_fn, str):
            for spec in sync_specs(sch.mod, mode):
                if spec.op == sync_op_or_fn and spec.axis == axis:
                    # the same collective twice at one point sums (or gathers) twice: a re-run notebook cell or a
                    # schedule applied twice, never a layout
                    along = f" along axis {axis}" if axis is not None else ""
                    raise SyncError(f"{where}: a {sync_op_or_fn}{along} at {mode} is already there (its sync module "
                                    f"'{spec.child}'); a second one would apply it twice. Valid: one {sync_op_or_fn} "
                                    f"per point; start from a fresh schedule to apply the plan again")
        if sync_op_or_fn in ("all_gather", "reduce_scatter"):
            if axis is None:
                raise SyncError(f"{where}: sync op {sync_op_or_fn!r} needs axis=<int> (the dimension to "
                                f"{'gather' if sync_op_or_fn == 'all_gather' else 'scatter'} along)")
            rank = _probed_rank(sch, mode)
            if rank is not None:
                _check_axis(where, mode, sync_op_or_fn, axis, rank, shape=None)
        elif axis is not None:
            raise SyncError(f"{where}: sync op {sync_op_or_fn!r} takes no axis (got axis={axis!r}); only all_gather "
                            "and reduce_scatter do")
        return {"mode": mode, "sync_op_or_fn": sync_op_or_fn, **options}

    @classmethod
    def apply(cls, sch, mode, sync_op_or_fn, axis=None, tensor_parallel_output_grad=True):
        # Slapo's (and Megatron's) meaning: True, the consumer is tensor parallel and each rank holds a partial
        # gradient (reduce-scatter it); False, the consumer is replicated (keep this rank's slice)
        op = SyncOp(mode, sync_op_or_fn, axis=axis, group=sch.group, grad_is_replicated=not tensor_parallel_output_grad)
        attach_sync(sch.mod, op)  # lists the sync in the module's record
        if axis is not None:
            op.register_forward_pre_hook(AxisCheck(sch.path, mode, sync_op_or_fn, axis))
        return None


def _cannot_take_one_tensor(fn: Callable) -> str:
    """Why ``fn(tensor)`` cannot bind (``""`` when it can, or when ``fn`` has no readable signature): checked at
    call time, since the sync point first calls it in the middle of a forward."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return ""
    try:
        signature.bind(None)
    except TypeError as e:
        return f"its signature is {signature}: {e}"
    return ""


_WHAT = {"fwd_pre": "input", "fwd_post": "output", "bwd_post": "input (whose gradient it applies to)"}


def _check_axis(where: str, mode: str, op: str, axis: int, rank: int, shape) -> None:
    if -rank <= axis < rank:
        return
    seen = f"has shape {tuple(shape)}" if shape is not None else f"has {rank} dimension{'s' if rank != 1 else ''}"
    valid = (f"{', '.join(map(str, range(rank)))} (or {', '.join(map(str, range(-rank, 0)))})" if rank
             else "none (it is a 0-d tensor)")
    raise SyncError(f"{where}: cannot {op} along axis {axis} at {mode}: the module's {_WHAT[mode]} {seen}, so "
                    f"valid axes are {valid}")


class AxisCheck:
    """Forward pre-hook of a SyncOp: the axis fits the tensor, checked before any collective runs."""

    def __init__(self, path: str, mode: str, op: str, axis: int):
        self.path, self.mode, self.op, self.axis = path, mode, op, axis

    def __call__(self, module, args):
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            return
        where = self.path or "<root>"
        _check_axis(where, self.mode, self.op, self.axis, x.dim(), x.shape)
        # the ops that split the tensor into equal slices, one per rank: a reduce-scatter in forward, and at
        # bwd_post an all_gather of the gradient, whose forward keeps this rank's slice
        splits = self.op == "reduce_scatter" if self.mode != "bwd_post" else self.op == "all_gather"
        world = world_size(getattr(module, "group", None))
        if splits and world > 1:
            verb = "reduce-scatter" if self.op == "reduce_scatter" else "split"
            check_even_split(where, verb, x, self.axis, world, f" (sync op {self.op!r} at {self.mode})")

    def __repr__(self) -> str:
        return f"AxisCheck({self.path!r}, {self.mode!r}, {self.op!r}, axis={self.axis})"


# -------------------------------------------------------------------------------- shape probe

def _first_tensor(value: Any, output: bool) -> Optional[torch.Tensor]:
    """The tensor a sync would act on (as ``SyncHook`` picks it)."""
    if output:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
            return value[0]
        if isinstance(value, dict) and value:
            first = next(iter(value.values()))
            return first if isinstance(first, torch.Tensor) else None
        return None
    args, kwargs = value
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


def _hf_model_around(sch) -> Optional[Tuple[str, Any]]:
    """``(path, module)`` of the outermost transformers model holding (or being) this module (outermost,
    so that one probe serves every module of the model)."""
    from ..graph.tracer import is_hf_model

    root = sch.root.mod
    parts = sch.path.split(".") if sch.path else []
    for k in range(len(parts) + 1):
        path = ".".join(parts[:k])
        module = root.get_submodule(path) if path else root
        if is_hf_model(module):
            return path, module
    return None


def _record_ranks(model) -> Dict[str, Tuple[Optional[int], Optional[int]]]:
    """Input and output rank of every module of the transformers ``model``, from one run on fake
    ``input_ids`` with every hook switched off (no collectives; shapes as the rank sees them)."""
    import collections

    from ..graph import tracer as T

    ranks: Dict[str, list] = {}
    saved, handles = [], []
    for path, m in model.named_modules():
        saved.append((m, m._forward_hooks, m._forward_pre_hooks))
        m._forward_hooks, m._forward_pre_hooks = collections.OrderedDict(), collections.OrderedDict()

        def before(mod, args, kwargs, path=path):
            t = _first_tensor((args, kwargs), output=False)
            ranks.setdefault(path, [None, None])[0] = None if t is None else t.dim()

        def after(mod, args, out, path=path):
            t = _first_tensor(out, output=True)
            ranks.setdefault(path, [None, None])[1] = None if t is None else t.dim()

        handles.append(m.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(m.register_forward_hook(after))
    try:
        T.fake_ids_forward(model)()
    finally:
        for h in handles:
            h.remove()
        for m, fwd, pre in saved:
            m._forward_hooks, m._forward_pre_hooks = fwd, pre
    return {p: (r[0], r[1]) for p, r in ranks.items()}


def _probed_rank(sch, mode: str) -> Optional[int]:
    """Rank of the tensor a ``mode`` sync at ``sch`` acts on, if a probe can tell (else None)."""
    found = _hf_model_around(sch)
    if found is None:
        return None
    ancestor_path, model = found
    state = sch._state
    plan = list(sch.plan)
    cached = _PROBES.get(state)
    key = (id(model), ancestor_path)
    if cached is None or cached[0] != key or any(s.primitive not in _RANK_PRESERVING for s in plan[cached[1]:]):
        try:
            ranks = _record_ranks(model)
        except Exception as e:  # the check falls back to the first forward
            logger.debug("%s: could not probe tensor ranks in %s: %s", sch.path or "<root>",
                         ancestor_path or "<root>", e)
            ranks = {}
        cached = (key, len(plan), ranks)
        _PROBES[state] = cached
    relative = sch.path[len(ancestor_path):].lstrip(".") if ancestor_path else sch.path
    entry = cached[2].get(relative)
    if entry is None:
        return None
    return entry[1] if mode == "fwd_post" else entry[0]

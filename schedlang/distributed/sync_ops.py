"""Synchronization points inserted by ``Schedule.sync``.

A sync point is a small parameter-free child module (:class:`SyncOp`) named
``_schedlang_sync_<mode>_<k>``, listed (as a :class:`~schedlang.module_record.SyncSpec`) in
its parent's record, and a forward hook on the parent that runs it. Keeping the collective
in a child module (not inside a closure) matters for tracing: FX records the call as a
``call_module`` node of a leaf module, so a sync survives ``.trace()`` and prints by name
in the graph.

One function runs a sync point, :func:`run_sync`. The hooks call it; a module whose output
sync must come before its bias is added (a row-parallel linear adds the bias once, after the
all-reduce) has ``syncs_before_bias`` in its record and no ``fwd_post`` hook: its forward calls
:func:`run_post_syncs` (which calls :func:`run_sync` for each ``fwd_post`` sync of the same
record) between the partial product and the bias.

Modes (what the op is applied to):

* ``fwd_pre``  - the module's first positional tensor input (or, when the module is called
  with keyword arguments only, as HF decoder layers call their attention, its first tensor
  keyword argument), in forward;
* ``fwd_post`` - the module's output (first element of a tuple output), in forward;
* ``bwd_post`` - the gradient of the module's first tensor input, i.e. after the module's
  backward. ``all_reduce`` is an identity in forward; ``all_gather`` of the gradient along
  ``axis`` keeps this rank's slice of the input in forward, and ``reduce_scatter`` of the
  gradient gathers the input in forward (each forward is the adjoint of its backward, so
  shapes stay consistent).
"""

from __future__ import annotations

import collections
import copy
from typing import Callable, Optional, Union

import torch
from torch import nn

from ..module_record import SyncSpec, module_record, record_sync, sync_specs, update_record
from . import collectives as C
from . import opaque_collectives as O
from .groups import world_size

__all__ = ["SyncOp", "SyncHook", "SYNC_MODES", "SYNC_OPS", "RESHARD_SCHEMES", "reshard", "hook_style", "sync_children", "attach_sync", "run_sync",
           "run_post_syncs", "bias_after_inner_syncs", "run_post_syncs_before_bias"]

SYNC_MODES = ("fwd_pre", "fwd_post", "bwd_post")
#: attribute set (by ``compile_layers``) on a SyncOp whose all-reduce a compiled graph holds as an opaque operator
OPAQUE_ATTR = "_schedlang_opaque_all_reduce"
SYNC_OPS = ("all_reduce", "all_gather", "reduce_scatter")
SYNC_PREFIX = "_schedlang_sync_"
#: Slapo's resharding schemes of an activation (..., seq, hidden): R replicated, S sharded; the first letter is
#: the sequence (second to last) axis, the second the hidden (last) one. Each is (axis gathered, axis kept a slice
#: of), counted from the end (None: nothing); see schedlang.sharding.reshard_ops
RESHARD_SCHEMES = {"RR->RR": (None, None), "RS->RS": (None, None), "SR->SR": (None, None),
                   "RR->RS": (None, -1), "RR->SR": (None, -2), "RS->RR": (-1, None), "SR->RR": (-2, None),
                   "RS->SR": (-1, -2), "SR->RS": (-2, -1)}


def reshard(x: torch.Tensor, scheme: str, group=None) -> torch.Tensor:
    """``x`` changed from one layout of ``RESHARD_SCHEMES`` to another, differentiably (the gradient goes back to
    the source layout). RS<->SR gathers then keeps a slice: more bytes than an all-to-all, but every backend
    (gloo has no all-to-all) runs it, and its gradient is the two collectives' adjoints."""
    gathered, kept = RESHARD_SCHEMES[scheme]
    if gathered is not None:
        x = C.gather_forward(x, x.dim() + gathered, group)
    if kept is not None:
        x = C.scatter_forward(x, x.dim() + kept, group)
    return x


def hook_style(fn: Callable, mode: str) -> bool:
    """Whether ``fn`` is a Slapo hook rather than ``fn(tensor)``: ``fn(module, input)`` at ``fwd_pre``,
    ``fn(module, input, output)`` at ``fwd_post`` (PyTorch's forward (pre-)hook signatures)."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    try:
        signature.bind(None)
        return False
    except TypeError:
        pass
    arity = {"fwd_pre": 2, "fwd_post": 3}.get(mode)
    if arity is None:
        return False
    try:
        signature.bind(*([None] * arity))
    except TypeError:
        return False
    return True


class SyncOp(nn.Module):
    """A collective (or user function) applied at one sync point. Always a leaf for tracing."""

    def __init__(self, mode: str, op: Union[str, Callable], axis: Optional[int] = None, group=None,
                 grad_is_replicated: bool = True):
        super().__init__()
        self.mode = mode
        self.op = op
        self.axis = axis
        self.group = group
        self.grad_is_replicated = grad_is_replicated
        #: a Slapo hook fn(module, input[, output]): its SyncHook calls it with the module and its arguments
        self.hook_style = callable(op) and hook_style(op, mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.__dict__.get("hook_style"):
            raise RuntimeError(f"the {self.mode} sync {getattr(self.op, '__name__', self.op)}(module, input"
                               f"{', output' if self.mode == 'fwd_post' else ''}) is a hook: it runs from its "
                               "module's forward hooks only, not inside a traced graph or a row-parallel forward; "
                               "give a function fn(tensor) -> tensor there")
        if callable(self.op):
            return self.op(x)
        if self.op in RESHARD_SCHEMES:
            return reshard(x, self.op, self.group)
        if self.__dict__.get(OPAQUE_ATTR) and world_size(self.group) > 1:
            # inside a compiled layer: one opaque operator the graph keeps whole (opaque_collectives)
            name = O.group_name(self.group)
            if self.mode == "bwd_post":
                return O.opaque_reduce_backward(x, name)
            return O.opaque_reduce_forward(x, name)
        if self.mode == "bwd_post":
            if self.op == "all_reduce":
                return C.reduce_backward(x, self.group)
            # a collective on the gradient that changes its shape needs the adjoint change in forward:
            # gathering the gradient means the forward keeps this rank's slice, reduce-scattering it
            # means the forward gathers
            if self.op == "all_gather":
                return C.scatter_forward(x, self.axis, self.group)
            return C.gather_forward(x, self.axis, self.group, grad_is_replicated=False)
        if self.op == "all_reduce":
            return C.reduce_forward(x, self.group)
        if self.op == "all_gather":
            return C.gather_forward(x, self.axis, self.group, self.grad_is_replicated)
        return C.reduce_scatter_forward(x, self.axis, self.group)

    def __deepcopy__(self, memo):
        # process groups cannot be copied; every copy of a schedule talks to the same group
        new = SyncOp.__new__(SyncOp)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = value if key == "group" else copy.deepcopy(value, memo)
        return new

    def extra_repr(self) -> str:
        op = getattr(self.op, "__qualname__", repr(self.op)) if callable(self.op) else self.op
        axis = "" if self.axis is None else f", axis={self.axis}"
        return f"mode={self.mode}, op={op}{axis}, world_size={world_size(self.group)}"


def _first_tensor_index(args) -> Optional[int]:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return i
    return None


def run_sync(module: nn.Module, child: str, x: torch.Tensor) -> torch.Tensor:
    """Run ``module``'s sync point ``child`` (a name its record lists) on ``x``: the one way a sync runs."""
    return getattr(module, child)(x)


def run_post_syncs(module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """``out`` through every ``fwd_post`` sync of ``module``'s record, in order (for a module whose
    record says ``syncs_before_bias``: its forward calls this before adding the bias)."""
    for spec in sync_specs(module, "fwd_post"):
        out = run_sync(module, spec.child, out)
    return out


class SyncHook:
    """Forward (pre-)hook that routes the module's input or output through one of its sync points."""

    def __init__(self, child_name: str, mode: str):
        self.child_name = child_name
        self.mode = mode

    def __call__(self, module: nn.Module, args, *rest):
        def sync(x):
            return run_sync(module, self.child_name, x)

        op = getattr(module, self.child_name)
        if op.__dict__.get("hook_style"):
            return self._call_hook(op.op, module, args, *rest)

        if self.mode in ("fwd_pre", "bwd_post"):
            # registered with_kwargs=True: rest == (kwargs,) and the hook returns (args, kwargs)
            kwargs = rest[0] if rest else None
            i = _first_tensor_index(args)
            if i is not None:
                args = args[:i] + (sync(args[i]),) + args[i + 1:]
                return args if kwargs is None else (args, kwargs)
            key = next((k for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor)), None)
            if key is None:
                raise RuntimeError(f"{type(module).__name__}: {self.mode} sync needs a tensor input")
            return args, {**kwargs, key: sync(kwargs[key])}
        output = rest[0]
        if isinstance(output, torch.Tensor):
            return sync(output)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (sync(output[0]),) + output[1:]
        if isinstance(output, dict) and output:
            key = next(iter(output))
            output[key] = sync(output[key])
            return output
        raise RuntimeError(f"{type(module).__name__}: fwd_post sync found no tensor output "
                           f"(got {type(output).__name__})")

    def _call_hook(self, fn: Callable, module: nn.Module, args, *rest):
        """Run a Slapo hook as PyTorch would: a pre-hook's result (None: unchanged) is the new input, a hook's
        result (None: unchanged) the new output."""
        if self.mode == "fwd_post":
            return fn(module, args, rest[0])
        kwargs = rest[0] if rest else None
        result = fn(module, args)
        if result is None:
            return None
        new_args = result if isinstance(result, tuple) else (result,)
        return new_args if kwargs is None else (new_args, kwargs)

    def __repr__(self) -> str:
        return f"SyncHook({self.child_name!r}, {self.mode!r})"


def sync_children(module: nn.Module):
    """(name, SyncOp) pairs of the sync points attached to ``module``, in its record's order."""
    return [(spec.child, getattr(module, spec.child)) for spec in sync_specs(module)
            if isinstance(getattr(module, spec.child, None), SyncOp)]


def attach_sync(module: nn.Module, sync: SyncOp) -> str:
    """Add ``sync`` as a child of ``module``, list it in the module's record and hook it in; returns the
    child's name."""
    k = sum(1 for spec in sync_specs(module, sync.mode))
    name = f"{SYNC_PREFIX}{sync.mode}_{k}"
    while name in module._modules:
        k += 1
        name = f"{SYNC_PREFIX}{sync.mode}_{k}"
    module.add_module(name, sync)
    record_sync(module, SyncSpec(mode=sync.mode, op=sync.op, child=name, axis=sync.axis))
    if sync.mode == "fwd_post" and module_record(module).syncs_before_bias:
        pass  # the module's forward runs it (run_post_syncs), before adding its bias
    elif sync.mode == "fwd_post":
        module.register_forward_hook(SyncHook(name, sync.mode))
    else:
        module.register_forward_pre_hook(SyncHook(name, sync.mode), with_kwargs=True)
    return name


def bias_after_inner_syncs(module: nn.Module, bias: torch.Tensor) -> torch.Tensor:
    """The bias a row-parallel module adds after its forward-post syncs.

    After an all-reduce every rank adds the bias to the whole output, and its gradient is
    already complete. After a reduce-scatter (sequence parallelism) each rank adds it to its
    own slice only, so the bias gradient must be summed over that sync's group.
    """
    for spec in sync_specs(module, "fwd_post"):
        if spec.op == "reduce_scatter":
            return C.reduce_backward(bias, getattr(module, spec.child).group)
    return bias


def run_post_syncs_before_bias(module: nn.Module) -> None:
    """Record that ``module``'s forward runs its forward-post syncs itself, before adding its bias.

    Used by shard rules when a module becomes row parallel: its output is a partial sum, so
    the bias must be added once, after the all-reduce. The module's forward must call
    :func:`run_post_syncs`. The hooks of syncs added earlier go (the record still lists those
    syncs); later ones get none (:func:`attach_sync`).
    """
    update_record(module, syncs_before_bias=True)
    hooks = collections.OrderedDict((key, hook) for key, hook in module._forward_hooks.items()
                                    if not (isinstance(hook, SyncHook) and hook.mode == "fwd_post"))
    module._forward_hooks = hooks  # a new table, so undoing a failed step restores the old one

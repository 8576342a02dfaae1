"""Synchronization points inserted by ``Schedule.sync``.

A sync point is a small parameter-free child module (:class:`SyncOp`) named
``_schedlang_sync_<mode>_<k>`` plus a forward hook on its parent that calls it. Keeping
the collective in a child module (not inside a closure) matters for tracing: FX
records the call as a ``call_module`` node of a leaf module, so a sync survives
``.trace()`` and prints by name in the graph.

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

import copy
from typing import Callable, Optional, Union

import torch
from torch import nn

from . import collectives as C
from .groups import world_size

__all__ = ["SyncOp", "SyncHook", "SYNC_MODES", "SYNC_OPS", "sync_children", "attach_sync", "bias_after_inner_syncs",
           "run_post_syncs_before_bias"]

SYNC_MODES = ("fwd_pre", "fwd_post", "bwd_post")
SYNC_OPS = ("all_reduce", "all_gather", "reduce_scatter")
SYNC_PREFIX = "_schedlang_sync_"


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if callable(self.op):
            return self.op(x)
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


class SyncHook:
    """Forward (pre-)hook that routes the module's input or output through its SyncOp child."""

    def __init__(self, child_name: str, mode: str):
        self.child_name = child_name
        self.mode = mode

    def __call__(self, module: nn.Module, args, *rest):
        sync = getattr(module, self.child_name)
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
        raise RuntimeError(f"{type(module).__name__}: fwd_post sync found no tensor output (got {type(output).__name__})")

    def __repr__(self) -> str:
        return f"SyncHook({self.child_name!r}, {self.mode!r})"


def sync_children(module: nn.Module):
    """(name, SyncOp) pairs of the sync points attached to ``module``."""
    return [(n, m) for n, m in module.named_children() if isinstance(m, SyncOp)]


def attach_sync(module: nn.Module, sync: SyncOp) -> str:
    """Add ``sync`` as a child of ``module`` and hook it in; returns the child's name.

    A module may run its forward-post syncs itself, before adding a bias (a row-parallel
    linear must add its bias once, after the all-reduce, not on every rank): such a module
    lists them in ``_schedlang_inner_post_syncs`` instead of getting a hook.
    """
    k = sum(1 for n, _ in sync_children(module) if n.startswith(f"{SYNC_PREFIX}{sync.mode}_"))
    name = f"{SYNC_PREFIX}{sync.mode}_{k}"
    module.add_module(name, sync)
    if sync.mode == "fwd_post" and hasattr(module, "_schedlang_inner_post_syncs"):
        module._schedlang_inner_post_syncs = list(module._schedlang_inner_post_syncs) + [name]
    elif sync.mode == "fwd_post":
        module.register_forward_hook(SyncHook(name, sync.mode))
    else:
        module.register_forward_pre_hook(SyncHook(name, sync.mode), with_kwargs=True)
    return name


def bias_after_inner_syncs(module: nn.Module, bias: torch.Tensor) -> torch.Tensor:
    """The bias a row-parallel module adds after its inner forward-post syncs.

    After an all-reduce every rank adds the bias to the whole output, and its gradient is
    already complete. After a reduce-scatter (sequence parallelism) each rank adds it to its
    own slice only, so the bias gradient must be summed over that sync's group.
    """
    for name in getattr(module, "_schedlang_inner_post_syncs", ()):
        sync = getattr(module, name)
        if isinstance(sync, SyncOp) and sync.op == "reduce_scatter":
            return C.reduce_backward(bias, sync.group)
    return bias


def run_post_syncs_before_bias(module: nn.Module) -> None:
    """Make ``module`` run its forward-post syncs itself, before adding its bias.

    Used by shard rules when a module becomes row parallel: its output is a partial sum, so
    the bias must be added once, after the all-reduce. Syncs registered earlier as forward
    hooks move into ``_schedlang_inner_post_syncs``; later ones go there directly
    (:func:`attach_sync`). The module's forward must honour that list.
    """
    inner = list(getattr(module, "_schedlang_inner_post_syncs", ()))
    for key, hook in list(module._forward_hooks.items()):
        if isinstance(hook, SyncHook) and hook.mode == "fwd_post":
            inner.append(hook.child_name)
            del module._forward_hooks[key]
    module._schedlang_inner_post_syncs = inner

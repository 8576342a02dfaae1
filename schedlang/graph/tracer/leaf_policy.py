"""Which calls stay one node: registered leaf functions, sync ops and HF ``Conv1D`` modules."""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from .core import SchedlangTracer


_LEAF_FUNCTIONS: Dict[int, Callable] = {}
_LEAF_WRAPPERS: Dict[int, Callable] = {}


def register_leaf_function(fn: Callable) -> Callable:
    """Record calls of ``fn`` as one ``call_function`` node instead of tracing into it.

    Use it for functions with data-dependent Python control flow. Works as a decorator;
    calls are intercepted through the module-level name the caller uses, as in
    ``torch.fx.wrap``. Example::

        @register_leaf_function
        def clamp_to_mask(x, mask):
            return x if mask is None or bool(mask.all()) else x * mask
    """
    if not callable(fn):
        raise TypeError(f"register_leaf_function expects a function, got {type(fn).__name__}")
    _LEAF_FUNCTIONS[id(fn)] = fn
    return fn


def _leaf_wrapper(fn: Callable) -> Callable:
    wrapper = _LEAF_WRAPPERS.get(id(fn))
    if wrapper is not None:
        return wrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tracer = _tracer_of((args, kwargs))
        if tracer is None:
            return fn(*args, **kwargs)
        return tracer.record_leaf_call(fn, args, kwargs)

    wrapper.__schedlang_leaf_of__ = fn
    _LEAF_WRAPPERS[id(fn)] = wrapper
    return wrapper


def _tracer_of(tree: Any) -> Optional["SchedlangTracer"]:
    from .core import SchedlangTracer

    for leaf in torch.utils._pytree.tree_leaves(tree):
        if isinstance(leaf, fx.Proxy) and isinstance(leaf.tracer, SchedlangTracer):
            return leaf.tracer
    return None


def _sync_op_class():
    mod = sys.modules.get("schedlang.distributed.sync_ops")
    if mod is None:
        try:
            from ...distributed import sync_ops as mod
        except ImportError:  # pragma: no cover
            return None, None
    return getattr(mod, "SyncOp", None), getattr(mod, "SyncHook", None)


def _hf_leaf_types() -> Tuple[type, ...]:
    types_ = []
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(pytorch_utils, "Conv1D", None)
    if isinstance(conv1d, type):
        types_.append(conv1d)  # has its own shard rule: keep it a module
    return tuple(types_)



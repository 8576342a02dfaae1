"""Global patches active while tracing (leaf-function wrappers, attention registry, ``Proxy.__len__``)."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx
from torch import nn

from .common import UNKNOWN
from .hf_bridge import _default_leaf_functions
from .leaf_policy import _LEAF_FUNCTIONS, _leaf_wrapper
from .tracer_base import TracerBase


class _Patches:
    """Global patches (leaf-function wrappers, attention registry, Proxy.__len__), undone at exit."""

    def __init__(self):
        self.undo: List[Tuple[Any, str, Any, bool]] = []
        self.seen: Set[int] = set()
        self.leaf_ids: Dict[int, Callable] = {}

    def refresh_leaf_ids(self) -> None:
        self.leaf_ids = dict(_LEAF_FUNCTIONS)
        for fn in _default_leaf_functions():
            self.leaf_ids[id(fn)] = fn

    def patch_globals(self, namespace: Optional[dict]) -> None:
        if namespace is None or id(namespace) in self.seen:
            return
        self.seen.add(id(namespace))
        for name, value in list(namespace.items()):
            fn = self.leaf_ids.get(id(value))
            if fn is not None and fn is value:
                self.undo.append((namespace, name, value, True))
                namespace[name] = _leaf_wrapper(fn)

    def patch_attr(self, owner: Any, name: str, value: Any) -> None:
        had = name in owner.__dict__
        self.undo.append((owner, name, owner.__dict__.get(name), had))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, old, had in reversed(self.undo):
            if isinstance(owner, dict):
                owner[name] = old
            elif had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self.undo.clear()
        self.seen.clear()


_PATCH_LOCK = threading.RLock()
_ACTIVE: Dict[str, Any] = {"patches": None, "depth": 0}


def _proxy_len(self):
    if isinstance(self.tracer, TracerBase):
        return self.tracer.len_of(self)
    return _ORIGINAL_PROXY_LEN(self)


_ORIGINAL_PROXY_LEN = fx.Proxy.__len__
_ORIGINAL_PROXY_GETATTR = fx.Proxy.__getattr__


def _proxy_getattr(self, name):
    # a proxy answers every attribute, so duck-typing probes in user code (``hasattr(x, "jax")``,
    # ``hasattr(x, "numpy")`` in framework-detection helpers) would take the wrong branch; a proxy
    # whose example is a tensor has exactly the tensor's attributes
    tracer = self.__dict__.get("tracer")
    if isinstance(tracer, TracerBase):
        example = tracer.metas.get(self.node, UNKNOWN)
        if isinstance(example, torch.Tensor) and not hasattr(example, name):
            raise AttributeError(f"'{type(example).__name__}' object has no attribute '{name}'")
    return _ORIGINAL_PROXY_GETATTR(self, name)


_ORIGINAL_FINFO, _ORIGINAL_IINFO = torch.finfo, torch.iinfo


def _example_dtype(value):
    """A proxy's example value when it is known (``x.dtype`` of a traced tensor), else ``value`` itself."""
    if isinstance(value, fx.Proxy) and isinstance(value.tracer, TracerBase):
        example = value.tracer.metas.get(value.node, UNKNOWN)
        if isinstance(example, torch.dtype):
            return example
    return value


def _finfo(*args):
    # torch.finfo(x.dtype) needs a real dtype (HF attention takes the mask value from it): the traced
    # tensor's dtype is read off its example, which fixes that constant to the dtype seen while tracing
    return _ORIGINAL_FINFO(*(_example_dtype(a) for a in args))


def _iinfo(*args):
    return _ORIGINAL_IINFO(*(_example_dtype(a) for a in args))


#: torch's factories that take the size as varargs (``torch.ones(batch, seq)``)
_SIZE_FACTORIES = ("ones", "zeros", "empty", "rand", "randn")


def _sized_factory(original):
    def factory(*size, **kwargs):
        # torch's argument parser matches varargs sizes only when they are ints, so torch.ones(b, s) with traced
        # sizes is a TypeError before any proxy is asked; one tuple of them reaches the tracer (as torch.ones((b, s)))
        if len(size) > 1 and any(isinstance(s, fx.Proxy) for s in size):
            return original(tuple(size), **kwargs)
        return original(*size, **kwargs)

    factory.__name__ = factory.__qualname__ = original.__name__
    return factory


@contextlib.contextmanager
def _tracing_patches(root: nn.Module):
    with _PATCH_LOCK:
        outer = _ACTIVE["patches"] is None
        if outer:
            patches = _Patches()
            patches.refresh_leaf_ids()
            patches.patch_attr(fx.Proxy, "__len__", _proxy_len)
            patches.patch_attr(fx.Proxy, "__getattr__", _proxy_getattr)
            patches.patch_attr(torch, "finfo", _finfo)
            patches.patch_attr(torch, "iinfo", _iinfo)
            for name in _SIZE_FACTORIES:
                patches.patch_attr(torch, name, _sized_factory(getattr(torch, name)))
            modeling_utils = sys.modules.get("transformers.modeling_utils")
            interface = getattr(modeling_utils, "AttentionInterface", None)
            if interface is not None:
                original_getitem = interface.__getitem__

                def getitem(self, key, _orig=original_getitem):
                    fn = _orig(self, key)
                    return _leaf_wrapper(fn) if callable(fn) else fn

                patches.patch_attr(interface, "__getitem__", getitem)
            _ACTIVE["patches"] = patches
        patches = _ACTIVE["patches"]
        _ACTIVE["depth"] += 1
        try:
            for m in root.modules():
                mod = sys.modules.get(type(m).__module__)
                patches.patch_globals(getattr(mod, "__dict__", None))
            for fn in list(patches.leaf_ids.values()):
                mod = sys.modules.get(getattr(fn, "__module__", "") or "")
                patches.patch_globals(getattr(mod, "__dict__", None))
            yield patches
        finally:
            _ACTIVE["depth"] -= 1
            if outer:
                _ACTIVE["patches"] = None
                patches.restore()



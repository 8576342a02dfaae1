"""Example-value propagation: every node carries a fake tensor computed by running its operation
under ``FakeTensorMode``, so Python control flow can be answered while tracing."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from .common import UNKNOWN, _describe, _is_fake, _NeedsExample
from .leaf_policy import _sync_op_class

logger = logging.getLogger("schedlang.graph.tracer")

@contextlib.contextmanager
def _plain_modules():
    """Undo FX's tracing patches of ``nn.Module`` while computing an example value, so that
    running a module on fake tensors does not record graph nodes."""
    patched_getattr, patched_call = nn.Module.__getattr__, nn.Module.__call__
    nn.Module.__getattr__ = fx._symbolic_trace._orig_module_getattr
    nn.Module.__call__ = fx._symbolic_trace._orig_module_call
    try:
        with _shape_only_syncs():
            yield
    finally:
        nn.Module.__getattr__, nn.Module.__call__ = patched_getattr, patched_call


def _shape_only_sync_forward(self, x):
    """SyncOp.forward for example values: the output shape, no communication."""
    if not isinstance(x, torch.Tensor) or callable(self.op) or self.mode == "bwd_post" or self.op == "all_reduce":
        return x
    from ...distributed.groups import world_size

    n = world_size(self.group)
    if self.op == "all_gather":
        return torch.cat([x] * n, dim=self.axis)
    return x.narrow(self.axis, 0, x.shape[self.axis] // n)


@contextlib.contextmanager
def _shape_only_syncs():
    """While example values are computed, sync ops return the right shape without a collective."""
    sync_op, _ = _sync_op_class()
    if sync_op is None or sync_op.__dict__.get("forward") is _shape_only_sync_forward:
        yield
        return
    original = sync_op.__dict__["forward"]
    sync_op.forward = _shape_only_sync_forward
    try:
        yield
    finally:
        sync_op.forward = original


class ExampleValues:
    """Tracer methods that compute and look up example values (mixed into ``SchedlangTracer``)."""

    @property
    def fake_mode(self):
        return self.options.fake_mode

    def _fake(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            # the examples of a meta model live on the CPU, as its synthesized inputs do (only shape, dtype and
            # strides count), also those a captured call computed from its meta weights: torch before 2.13 refuses
            # an operator that meets a meta and a CPU fake tensor
            with self.fake_mode:
                return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")
        if isinstance(value, torch.Tensor) and not _is_fake(value):
            try:
                return self.fake_mode.from_tensor(value)
            except Exception:  # pragma: no cover - exotic tensor subclasses
                return UNKNOWN
        return value

    def example_of(self, value: Any, strict: bool = True) -> Any:
        """Example value of a proxy / node / nested structure (UNKNOWN if not computable)."""
        try:
            return self._map_examples(value)
        except _NeedsExample:
            if strict:
                raise
            return UNKNOWN

    def _map_examples(self, value: Any) -> Any:
        if isinstance(value, fx.Proxy):
            value = value.node
        if isinstance(value, fx.Node):
            example = self.metas.get(value, UNKNOWN)
            if example is UNKNOWN:
                raise _NeedsExample()
            return example
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*[self._map_examples(v) for v in value])
        if isinstance(value, (list, tuple)):
            return type(value)(self._map_examples(v) for v in value)
        if isinstance(value, dict) and type(value) is dict:
            return {k: self._map_examples(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(self._map_examples(value.start), self._map_examples(value.stop),
                         self._map_examples(value.step))
        if isinstance(value, torch.Tensor):
            return self._fake(value)
        return value

    def _run_example(self, fn: Callable, args, kwargs) -> Any:
        try:
            ex_args = self._map_examples(tuple(args))
            ex_kwargs = self._map_examples(dict(kwargs))
        except _NeedsExample:
            return UNKNOWN
        try:
            with _plain_modules(), self.fake_mode:
                return fn(*ex_args, **ex_kwargs)
        except Exception as e:  # an example is a convenience: tracing goes on without it
            logger.debug("%s: no example value for %s: %s", self.where(), getattr(fn, "__name__", fn), _describe(e))
            return UNKNOWN

    def _compute_example(self, kind: str, target: Any, args, kwargs) -> Any:
        if kind == "call_method":
            def fn(obj, *rest, **kw):
                return getattr(obj, target)(*rest, **kw)
        else:
            fn = target
        return self._run_example(fn, args, kwargs)

    def _leaf_module_example(self, m: nn.Module, args, kwargs) -> Any:
        sync_op, sync_hook = _sync_op_class()
        if sync_op is not None and isinstance(m, sync_op):
            return self._run_example(lambda x: _shape_only_sync_forward(m, x), args[:1], {})
        forward = type(m).forward
        with self._cpu_fakes_for_meta_tensors(m):
            example = self._run_example(lambda *a, **k: forward(m, *a, **k), args, kwargs)
        if sync_hook is not None and example is not UNKNOWN:
            for hook in m._forward_hooks.values():
                if isinstance(hook, sync_hook):
                    sync = m._modules.get(hook.child_name)
                    if isinstance(example, torch.Tensor):
                        example = self._run_example(lambda x: _shape_only_sync_forward(sync, x), (example,), {})
                    elif isinstance(example, tuple) and example:
                        first = self._run_example(lambda x: _shape_only_sync_forward(sync, x), (example[0],), {})
                        example = (first,) + example[1:]
        return example


    @contextlib.contextmanager
    def _cpu_fakes_for_meta_tensors(self, m: nn.Module):
        """While a leaf module computes its example, its meta parameters and buffers are CPU fakes like every other
        example of a meta model (see :meth:`_fake`); they are put back afterwards."""
        swapped = []
        for module in m.modules():
            for store in (module._parameters, module._buffers):
                for name, t in store.items():
                    if isinstance(t, torch.Tensor) and t.device.type == "meta":
                        swapped.append((store, name, t))
        try:
            for store, name, t in swapped:
                store[name] = self._fake(t)
            yield
        finally:
            for store, name, t in swapped:
                store[name] = t

    def _map_examples_safe(self, value):
        def conv(v):
            if isinstance(v, torch.Tensor):
                return self._fake(v)
            if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
                return type(v)(conv(x) for x in v)
            if isinstance(v, dict) and type(v) is dict:
                return {k: conv(x) for k, x in v.items()}
            return v

        return conv(value)



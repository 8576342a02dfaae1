"""The guards that generated code runs: a specialized argument must keep its traced value, and a
condition or a length that Python read while tracing must come out the same."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch

from ...errors import TraceError
from .leaf_policy import register_leaf_function


def check_specialized_arguments(where: str, values: Dict[str, Any], expected: Dict[str, Any],
                                extra_kwargs: Optional[Dict[str, Any]] = None,
                                input_keys: Sequence[str] = ()) -> None:
    """Raise :class:`TraceError` if an argument that was specialized at trace time changed.

    ``expected`` maps names to the traced value; ``"<object>"`` stands for a value that has
    no literal form and accepts any non-tensor. ``None`` at call time is always accepted
    (it means "the default"); a different literal, or a tensor where the trace saw a
    non-tensor, is refused. Extra keyword arguments that were not traced must be None/False.
    """
    extra_kwargs = extra_kwargs or {}
    for name, want in expected.items():
        got = values[name] if name in values else extra_kwargs.get(name)
        if got is None:
            continue
        if isinstance(want, str) and want == "<object>":
            if isinstance(got, torch.Tensor):
                _specialization_failed(where, name, want, got)
            continue
        if not _same_literal(got, want):
            _specialization_failed(where, name, want, got)
    for name, got in extra_kwargs.items():
        if name in expected or name in input_keys or got is None or got is False:
            continue
        _specialization_failed(where, name, "<not passed>", got)


def _same_literal(got: Any, want: Any) -> bool:
    if isinstance(got, torch.Tensor):
        return False
    try:
        same = got == want
    except Exception:
        return False
    return same is True


def _specialization_failed(where, name, want, got) -> None:
    shown = f"a tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else repr(got)
    raise TraceError(
        f"{where}: the graph was traced with {name}={want!r} and cannot take {name}={shown}; trace the module "
        f"again with concrete_args={{'{name}': ...}} (a value to specialize on, or schedlang.graph.PH to make it "
        "a graph input)")


def check_traced_condition(value: Any, traced: bool, where: str, condition: str) -> None:
    """Raise :class:`TraceError` if a condition that decided a Python branch while tracing (``if x.size(1) > 1``)
    comes out otherwise now: the graph holds only the branch taken then."""
    # `bool(value) != traced` would compare a symbolic bool (under torch.compile) with a constant, which fails
    if (not value) if traced else value:
        raise TraceError(
            f"{where}: the graph was traced where '{condition}' was {traced}, and now it is {not traced}; the graph "
            "holds only the branch taken while tracing, so it cannot run on these inputs; trace the module again "
            "with example inputs of this kind (concrete_args), or keep it whole as a leaf (leaf_modules=[...])")


def check_traced_length(value: Any, traced: int, where: str, what: str) -> None:
    """Raise :class:`TraceError` if a value whose length Python read while tracing (a loop over a tensor's rows,
    a list unpacked) now has another length: the graph was unrolled to the traced one."""
    if len(value) != traced:
        raise TraceError(
            f"{where}: the graph was traced where len({what}) was {traced}, and now it is {len(value)}; the graph "
            "was unrolled to the traced length, so it cannot run on these inputs; trace the module again with "
            "example inputs of this size (concrete_args), or keep it whole as a leaf (leaf_modules=[...])")


_GUARDS = (check_specialized_arguments, check_traced_condition, check_traced_length)
try:  # keep the guards through dead-code elimination
    from torch.fx.node import has_side_effect as _has_side_effect

    for _guard in _GUARDS:
        _has_side_effect(_guard)
except ImportError:  # pragma: no cover - old torch
    pass

for _guard in _GUARDS:
    register_leaf_function(_guard)



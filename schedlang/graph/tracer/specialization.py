"""The guard that generated code runs: a specialized argument must keep its traced value."""

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


try:  # keep the guard through dead-code elimination
    from torch.fx.node import has_side_effect as _has_side_effect

    _has_side_effect(check_specialized_arguments)
except ImportError:  # pragma: no cover - old torch
    pass

register_leaf_function(check_specialized_arguments)



"""A context variable set for the duration of each call of one model: how a wrapped transformers helper
tells the calls of a model that ``optimize_model`` prepared from everyone else's.

:func:`wrap_masking_helper` puts such a wrapper in place of a ``transformers.masking_utils`` function, once.

:class:`ForwardMark` is a pair of root hooks. The forward pre-hook sets the variable (to what its ``value``
computes from the call's arguments), and the forward hook, which runs also when the forward raises, resets
it, so the mark never outlives the call and nested calls unwind in order. While ``torch.compile`` traces a
call the mark is left alone: a ContextVar cannot be traced, and the wrapped helpers then do not read it.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["ForwardMark", "wrap_masking_helper"]


def wrap_masking_helper(name: str, make_wrapper: Callable[[Callable], Optional[Callable]]) -> bool:
    """Replace ``transformers.masking_utils.<name>`` by ``make_wrapper(original)``, once per process (the
    module's own callers look the name up at call time). ``make_wrapper`` may return None to leave a helper
    it cannot serve (another signature) alone. Returns whether the wrapper is in place; False where
    transformers or the helper is missing."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    original = getattr(masking_utils, name, None)
    if original is None:
        return False
    if getattr(original, "_schedlang_wrapped", False):
        return True
    wrapper = make_wrapper(original)
    if wrapper is None:
        return False
    wrapper._schedlang_wrapped = True
    wrapper.__wrapped__ = original
    wrapper.__doc__ = original.__doc__
    setattr(masking_utils, name, wrapper)
    return True


class ForwardMark:
    """Set the subclass's ``variable`` to ``self.value(args, kwargs)`` (default True) during each call of the
    model it is installed on.

    The variable is a class attribute, so that a model carrying the hooks can still be copied and pickled
    (a ContextVar itself can be neither)::

        class _InModel(ForwardMark):
            variable = contextvars.ContextVar("in_model", default=False)

        _InModel().install(model)
    """

    variable: contextvars.ContextVar

    def __init__(self):
        self.tokens = []

    def value(self, args: tuple, kwargs: dict) -> Any:
        return True

    def install(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self.enter, with_kwargs=True)
        model.register_forward_hook(self.leave, always_call=True)

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.tokens.append(None if torch.compiler.is_compiling() else self.variable.set(self.value(args, kwargs)))
        return None

    def leave(self, module: nn.Module, args: tuple, output: Any) -> Any:
        token = self.tokens.pop() if self.tokens else None
        if token is not None:
            self.variable.reset(token)
        return output

"""Under CUDA graph capture, the causal mask is left to SDPA as it is outside the capture (no padding mask).

transformers' SDPA mask builder (``masking_utils.sdpa_mask``) leaves the causal mask out when no token is
padded, and SDPA then applies causality itself (``is_causal=True``, the layers get ``attention_mask=None``).
Some transformers releases (5.17 among them) build the full mask instead while a CUDA graph is being
captured: their check (``_ignore_causal_mask_sdpa``) takes a capture for tracing, because with a padding
mask it would have to read the mask on the host. Without a padding mask there is nothing to read, and the
answer outside the capture holds inside it too (later releases answer so themselves).

The difference breaks a whole training step captured after eager warm-up steps
(:class:`schedlang.CapturedStep`): the layers compiled during the warm-up with ``attention_mask=None``
meet a mask tensor under capture, fail their guards and compile again, which a capture cannot hold.

:func:`keep_causal_mask_skip_under_capture` makes the check give, in ``model``'s calls, while a graph is
captured and no padding mask is given, the answer it gives outside the capture. Calls with a padding
mask, calls traced by ``torch.compile`` or ``torch.jit``, and other models' calls go through
transformers' check unchanged.
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Optional

import torch
from torch import nn

from .forward_marks import ForwardMark, wrap_masking_helper

__all__ = ["keep_causal_mask_skip_under_capture", "skip_without_padding"]

# set while a marked model runs a forward (not while torch.compile traces one)
_IN_MARKED_MODEL = contextvars.ContextVar("schedlang_causal_mask_model", default=False)
# transformers' own check, which the wrapper calls for every other call
_ORIGINAL = []
_NEEDED = ("padding_mask", "q_length", "kv_length", "q_offset")


def skip_without_padding(q_length: int, kv_length: int, q_offset: int, local_attention_size: Optional[int] = None
                         ) -> bool:
    """transformers' answer, outside tracing and capture, to "can the causal mask be left to SDPA?" when no
    padding mask is given (a test pins this to the installed ``_ignore_causal_mask_sdpa``)."""
    if local_attention_size is not None and kv_length >= local_attention_size:
        return False  # a sliding window needs its own mask pattern
    # one query (decoding), a square mask (SDPA's upper-left causal alignment is then the right one), or an
    # empty cache (prefill)
    return q_length == 1 or kv_length == q_length or q_offset == 0


def _capturing_eagerly() -> bool:
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or not torch.cuda.is_available():
        return False
    return torch.cuda.is_current_stream_capturing()


def _wrap(original):
    signature = inspect.signature(original)
    if not all(name in signature.parameters for name in _NEEDED):
        return None  # not the check this wrapper knows how to read
    _ORIGINAL[:] = [original]

    def _ignore_causal_mask_sdpa(*args, **kwargs):
        if _IN_MARKED_MODEL.get() and _capturing_eagerly():
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            given = bound.arguments
            if given["padding_mask"] is None:
                return skip_without_padding(given["q_length"], given["kv_length"], given["q_offset"],
                                            given.get("local_attention_size"))
        return _ORIGINAL[0](*args, **kwargs)

    return _ignore_causal_mask_sdpa


class _MarkedModel(ForwardMark):
    """Marks the calls of a model whose check may answer under capture."""

    variable = _IN_MARKED_MODEL


def keep_causal_mask_skip_under_capture(model: nn.Module) -> bool:
    """In ``model``'s calls, let transformers leave the causal mask to SDPA while a CUDA graph is captured, as
    it does outside the capture, when no padding mask is given (see the module docstring).

    Returns False, changing nothing, where the installed transformers has no such check."""
    if not wrap_masking_helper("_ignore_causal_mask_sdpa", _wrap):
        return False
    _MarkedModel().install(model)
    return True

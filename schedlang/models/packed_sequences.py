"""No host synchronization for HF's packed-sequence check when the model makes its own positions.

transformers' mask builder (``masking_utils``) looks for several sequences packed into one row
whenever a training call has position ids and no attention mask: ``find_packed_sequence_indices``
computes, on the device, where the positions restart, then asks the host whether they ever do. That
question waits for the GPU to finish everything queued before it, once per forward; the GPU then
idles while the host queues the next kernels. For a step whose host and GPU times are close (GPT-2
medium on an H100, or any step replayed from CUDA graphs) the lost overlap costs milliseconds.

The positions a model makes itself (no ``position_ids`` passed) count up from the cache's length one
by one, so the check's answer is known: no packing. :func:`skip_packed_sequence_check` tells the
check so for such calls of one model, and only for them. A call that passes ``position_ids`` (packed
batches among them) goes through the check as before, and so does a model compiled whole by
``torch.compile``, whose traced check syncs nothing.

A pipeline runs its stages, not the model: the stages are traced pieces of it, and a hook on the model never
runs. :func:`skip_packed_sequence_check_in_stages` marks the stages of a model whose first stage makes the
positions itself (every call of such a stage then sees positions that count up).
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Sequence

import torch
from torch import nn

from .forward_marks import ForwardMark, wrap_masking_helper

__all__ = ["skip_packed_sequence_check", "skip_packed_sequence_check_in_stages"]

# set while a hooked model runs a forward whose positions it makes itself
_OWN_POSITIONS = contextvars.ContextVar("schedlang_own_positions", default=False)
# transformers' own check, which the wrapper calls for every other call
_ORIGINAL = []


def _wrap(original):
    _ORIGINAL[:] = [original]

    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        # traced by torch.compile (a whole model compiled): transformers' own check, which then syncs nothing
        if not torch.compiler.is_compiling() and _OWN_POSITIONS.get():
            return None  # positions the model counted up itself: one sequence per row
        return _ORIGINAL[0](position_ids, *args, **kwargs)

    return find_packed_sequence_indices


class _OwnPositionsMark(ForwardMark):
    """Marks a call of the model that passes no ``position_ids``, by name or by position."""

    variable = _OWN_POSITIONS

    def __init__(self, model: nn.Module):
        super().__init__()
        params = list(inspect.signature(type(model).forward).parameters)
        # its index among the positional arguments after self, or None when it cannot be given positionally
        self.index = params.index("position_ids") - 1 if "position_ids" in params else None

    def value(self, args, kwargs) -> bool:
        given = kwargs.get("position_ids")
        if given is None and self.index is not None and len(args) > self.index:
            given = args[self.index]
        return given is None


class _StageOfOwnPositionsMark(ForwardMark):
    """Marks every call of a pipeline stage cut from a model that makes its positions itself."""

    variable = _OWN_POSITIONS


def _positions_count_up(model: nn.Module) -> bool:
    """Whether the positions ``model`` makes itself are the plain count: not so for multimodal models, which
    derive them from the image or video layout (a rope index, ``mrope_section``)."""
    config = getattr(model, "config", None)
    if config is None:
        return True
    # rope_parameters in transformers 5; rope_scaling before it (read from the instance: the property warns)
    rope = getattr(config, "rope_parameters", None) or vars(config).get("rope_scaling") or {}
    return not (hasattr(config, "vision_config") or (isinstance(rope, dict) and "mrope_section" in rope))


def skip_packed_sequence_check(model: nn.Module) -> bool:
    """Skip transformers' packed-sequence check (a host sync) in ``model``'s calls without ``position_ids``.

    Returns False, changing nothing, where the installed transformers has no such check, or where the model
    does not count its positions up one by one (multimodal models)."""
    if not _positions_count_up(model) or not wrap_masking_helper("find_packed_sequence_indices", _wrap):
        return False
    _OwnPositionsMark(model).install(model)
    return True


def skip_packed_sequence_check_in_stages(model: nn.Module, stages: Sequence[nn.Module]) -> bool:
    """Skip transformers' packed-sequence check (a host sync) in every call of ``stages``, the pipeline stages cut
    from ``model``, for a pipeline whose first stage takes no ``position_ids`` (the positions it makes count up,
    and the later stages get them from it). A pipeline that is given the positions (context parallelism's
    load-balanced chunks, say) must not be marked: its check has something to find.

    Returns False, changing nothing, where the installed transformers has no such check, or where the model
    does not count its positions up one by one (multimodal models)."""
    if not _positions_count_up(model) or not wrap_masking_helper("find_packed_sequence_indices", _wrap):
        return False
    for stage in stages:
        _StageOfOwnPositionsMark().install(stage)
    return True


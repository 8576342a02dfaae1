"""Slapo's ways of calling ``Verify``, read into schedlang's: ``device=``, ``eval_mode=``, a single tensor
as ``example_inputs``, and a model on the meta device.

* ``example_inputs=x`` (one tensor) means ``[x]``.
* ``device="cuda:1"`` runs both models there: the original model's copy and the inputs are moved to it
  (default: an accelerator an input is on, else the one the model is on, else the CPU).
* ``eval_mode=True`` compares the models in eval mode only (no dropout), as Slapo does;
  ``eval_mode=False`` asks for the training-mode pass too. Left out, ``check_training`` decides.
* A model built under ``init_empty_weights()`` has no values to compare. Slapo materializes it; so does
  Verify: a copy of it is given real tensors on ``device``, initialized the way ``build`` would, and rank
  0's copy is the reference of every rank.
"""

from __future__ import annotations

import copy
from typing import Any, List, Optional

import torch
from torch import nn

from ..argument_checks import check_device
from ..errors import ScheduleTypeError, ScheduleValueError

__all__ = ["example_input_list", "verify_device", "training_check", "has_meta_tensors", "materialized_copy",
           "model_devices"]


def example_input_list(example_inputs: Any) -> List[Any]:
    """``example_inputs`` as a list: a list or tuple as it is, one tensor as ``[tensor]``."""
    if isinstance(example_inputs, torch.Tensor):
        return [example_inputs]
    if not isinstance(example_inputs, (list, tuple)):
        raise ScheduleValueError(f"Verify: example_inputs must be a tensor, or a list or tuple of inputs, got "
                                 f"{type(example_inputs).__name__}")
    return list(example_inputs)


def verify_device(device: Any) -> Optional[torch.device]:
    """``device=`` checked: None, a device string, a ``torch.device`` or a GPU index; it must exist here."""
    dev = check_device("Verify", device)
    if dev is not None and dev.type not in ("cpu", "cuda"):
        raise ScheduleValueError(f"Verify: device {device!r} cannot run the models: use 'cpu' or 'cuda'")
    return dev


def training_check(eval_mode: Any, check_training: bool) -> bool:
    """Whether to run the training-mode pass: Slapo's ``eval_mode=True`` means eval mode only."""
    if eval_mode is None:
        return check_training
    if not isinstance(eval_mode, bool):
        raise ScheduleTypeError(f"Verify: eval_mode must be True (compare in eval mode only, Slapo's default) or "
                                f"False (also in training mode), got {eval_mode!r}")
    return not eval_mode


def model_devices(model: nn.Module) -> List[torch.device]:
    """The device of the model's first parameter or buffer (none for a model without tensors)."""
    for t in list(model.parameters()) + list(model.buffers()):
        return [t.device]
    return []


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def materialized_copy(model: nn.Module, device: torch.device, seed: int) -> nn.Module:
    """A copy of the meta-device ``model`` with real tensors on ``device``, initialized as ``build`` does
    (each module's ``reset_parameters``, a HF model's ``_init_weights``) from ``seed``; ``model`` is unchanged."""
    from ..materialize import DEFAULT_INIT, Materializer, default_inits

    copy_ = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        Materializer(device, DEFAULT_INIT, default_inits(copy_)).run(copy_)
    return copy_


"""Checks of plain function arguments (numbers, ints, tensors) that raise in the project's voice.

Public functions outside the schedule (the kernels, ``Verify``, the optimizers) take numbers and
tensors straight from users. Without a check, a bad one fails deep inside PyTorch or Triton with a
message about some internal line, or worse, computes garbage (a long tensor normalized to zeros). Each
check here raises a :class:`~schedlang.errors.SchedlangError` naming the function, the argument, the
value and what would be valid::

    rms_norm: eps must be a finite number >= 0, got 'x'

A value of the wrong Python type raises :class:`~schedlang.errors.ArgumentTypeError` (both a
``TypeError`` and a ``ValueError``); a value of the right type out of range raises
:class:`~schedlang.errors.ScheduleValueError`.

The module imports only torch and :mod:`schedlang.errors`, so any layer may use it (the kernels
without importing Triton into the others).

Example::

    check_number("rms_norm", "eps", eps, minimum=0)
    check_tensor("swiglu", "gate", gate, dtypes=FLOATING_DTYPES)
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from .errors import ArgumentTypeError, ScheduleTypeError, ScheduleValueError

__all__ = ["FLOATING_DTYPES", "check_int", "check_number", "check_tensor", "check_integer_tensor", "check_arity",
           "shown"]

#: dtypes the training-step kernels compute in: the three the Triton kernels take, and float64, for which
#: the PyTorch reference runs
FLOATING_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: a message must stay one readable line even when a
    whole model or a long list was passed by mistake."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


# _checked_by_eager_calls: while torch.compile traces, a number argument may be symbolic (``dynamic=True``
# makes a float a SymFloat); testing its range would break the graph on a data-dependent branch. Numbers are
# checked in eager calls only; tensors (type, dtype, rank are static under tracing) are checked always.


def check_int(where: str, name: str, value: Any, minimum: Optional[int] = None) -> None:
    """``value`` is an int (a bool is not) and at least ``minimum``."""
    _check_real(where, name, value, minimum, numbers.Integral, "an int", finite=False)


def check_number(where: str, name: str, value: Any, minimum: Optional[float] = None) -> None:
    """``value`` is a finite real number (an int or a float; a bool is not) and at least ``minimum``."""
    _check_real(where, name, value, minimum, numbers.Real, "a finite number", finite=True)


def _check_real(where: str, name: str, value: Any, minimum, kind: type, described: str, finite: bool) -> None:
    if torch.compiler.is_compiling():  # see _checked_by_eager_calls
        return
    bound = f" >= {minimum}" if minimum is not None else ""
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ArgumentTypeError(f"{where}: {name} must be {described}{bound}, got {shown(value)}")
    if (finite and not math.isfinite(value)) or (minimum is not None and value < minimum):
        raise ScheduleValueError(f"{where}: {name} must be {described}{bound}, got {value}")


def check_tensor(where: str, name: str, value: Any, dtypes: Optional[Sequence[torch.dtype]] = None,
                 min_dim: int = 0) -> None:
    """``value`` is a tensor of one of ``dtypes`` (any dtype when None) with at least ``min_dim`` dimensions."""
    if not isinstance(value, torch.Tensor):
        raise ArgumentTypeError(f"{where}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        raise ScheduleValueError(f"{where}: {name} has dtype {value.dtype}: expected one of {_dtype_names(dtypes)}")
    if value.dim() < min_dim:
        raise ScheduleValueError(f"{where}: {name} of shape {tuple(value.shape)} must have at least {min_dim} "
                                 f"dimension{'s' if min_dim > 1 else ''}")


def check_integer_tensor(where: str, name: str, value: Any) -> None:
    """``value`` is a tensor of an integer dtype (class ids, token ids; a bool tensor is not)."""
    check_tensor(where, name, value)
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise ScheduleValueError(f"{where}: {name} has dtype {value.dtype}: expected an integer dtype "
                                 f"(e.g. torch.long) of class ids")


def check_arity(where: str, label: str, fn: Callable, calling: str, args: Sequence[Any] = (),
                kwargs: Optional[Mapping[str, Any]] = None) -> None:
    """``fn`` accepts ``fn(*args, **kwargs)`` by its signature, checked before the first call so that a
    function of the wrong arity fails with the place and the arguments it will get (``calling``, in words,
    e.g. ``"(path, module)"``), not with a bare TypeError from inside a loop. A callable without a readable
    signature (some builtins) is let through: its own call says what is wrong."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **(kwargs or {}))
    except TypeError as e:
        raise ScheduleValueError(f"{where}: {label}{signature} cannot be called with {calling}: {e}; "
                                 f"give a function that takes {calling}") from None


def check_device(where: str, device: Any, also_valid: str = "") -> Optional[torch.device]:
    """``device`` as a ``torch.device`` (None stays None): a device string, a ``torch.device`` or a GPU index
    that names a device this process has, for CUDA. ``also_valid`` adds to the list of valid spellings a
    message gives (``", 'meta'"``). Other device types are the caller's to accept or refuse."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise ScheduleTypeError(f"{where}: device must be a string such as 'cpu' or 'cuda:0', a torch.device or a "
                                f"GPU index, got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ScheduleValueError(f"{where}: device {device!r} is not a device: valid are 'cpu', 'cuda', "
                                 f"'cuda:N'{also_valid} or a torch.device") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ScheduleValueError(f"{where}: device {device!r} asks for CUDA, but no CUDA device is available; "
                                     "use device='cpu'")
        if dev.index is not None and dev.index >= count:
            raise ScheduleValueError(f"{where}: device {device!r} does not exist: valid CUDA indices are "
                                     f"0..{count - 1}")
    return dev

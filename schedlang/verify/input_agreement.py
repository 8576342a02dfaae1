"""Before Verify broadcasts anything: every rank passes example inputs and a model of the same shapes.

Verify runs rank 0's weights and example inputs on every rank: it broadcasts them. A broadcast
needs every rank to hold a tensor of the same size; gloo aborts the whole process when one does
not ("Received data size doesn't match expected size"), NCCL hangs or corrupts memory. A user
who slices the data per rank before verifying hits exactly that.

:func:`check_inputs_agree` therefore first exchanges a short description of each rank's inputs
(shape and dtype of each tensor, the type of every other value, the value of plain scalars) and
of its model (the shape and dtype of every parameter and buffer) through the job's key-value
store (:func:`~schedlang.distributed.agreement.exchange`, no collective), and raises
:class:`ExampleInputMismatchError` on every rank when they differ, naming the ranks and the shapes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..distributed import groups
from ..distributed.agreement import exchange
from ..errors import ScheduleValueError

__all__ = ["ExampleInputMismatchError", "check_inputs_agree", "describe_value"]

#: how many differing inputs (or tensors of the model) one message names
_SHOWN = 4


class ExampleInputMismatchError(ScheduleValueError):
    """The ranks pass example inputs (or models) of different shapes or dtypes to ``Verify``; raised on every rank."""


def describe_value(value: Any) -> str:
    """A short description that is equal on two ranks exactly when Verify can broadcast one onto the other."""
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if value is None or isinstance(value, (bool, int, float, str)):
        text = repr(value)
        return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
    return type(value).__name__


def _inputs(args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Tuple[str, str]]:
    return ([(f"input[{i}]", describe_value(a)) for i, a in enumerate(args)]
            + [(f"input '{k}'", describe_value(v)) for k, v in sorted(kwargs.items())])


def _model(model: nn.Module) -> List[Tuple[str, str]]:
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return [(name, describe_value(t)) for name, t in tensors]


def _differences(what: str, per_rank: List[List[Tuple[str, str]]]) -> List[str]:
    """Lines naming each entry whose description differs between rank 0 and another rank."""
    lines: List[str] = []
    names = list(dict.fromkeys(n for entries in per_rank for n, _ in entries))
    tables = [dict(entries) for entries in per_rank]
    for name in names:
        seen = [table.get(name, "nothing") for table in tables]
        if len(set(seen)) == 1:
            continue
        by_value: Dict[str, List[int]] = {}
        for rank, description in enumerate(seen):
            by_value.setdefault(description, []).append(rank)
        parts = [f"{'rank' if len(r) == 1 else 'ranks'} {', '.join(map(str, r))}: {d}" for d, r in by_value.items()]
        lines.append(f"  {what}{name}: " + "; ".join(parts))
    if len(lines) > _SHOWN:
        lines = lines[:_SHOWN] + [f"  ... and {len(lines) - _SHOWN} more"]
    return lines


def check_inputs_agree(args: Sequence[Any], kwargs: Dict[str, Any], model: nn.Module, group,
                       timeout: Optional[float] = None) -> None:
    """Raise :class:`ExampleInputMismatchError` on every rank of ``group`` unless every rank passes example
    inputs and a model of the same shapes and dtypes (the values may differ: rank 0's are used)."""
    if groups.world_size(group) <= 1:
        return
    mine = (_inputs(args, kwargs), _model(model))
    everyone = exchange(mine, group, phase="verify: example inputs agree across ranks", timeout=timeout)
    inputs = _differences("", [e[0] for e in everyone])
    tensors = _differences("parameter or buffer '", [[(f"{n}'", d) for n, d in e[1]] for e in everyone])
    if not inputs and not tensors:
        return
    subject = " and ".join((["the example inputs"] if inputs else [])
                           + (["the original model's tensors"] if tensors else []))
    details = "\n".join(inputs + tensors)
    raise ExampleInputMismatchError(
        f"Verify: {subject} differ across ranks:\n{details}\nVerify runs rank 0's inputs and weights on every rank (it "
        f"broadcasts them), so every rank must pass example inputs of the same shapes and dtypes (the values may "
        f"differ) and build the same model; pass the same example_inputs on every rank, and split the data per rank "
        f"only after verifying")

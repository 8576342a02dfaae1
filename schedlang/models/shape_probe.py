"""Run a model once on fake tensors: does its forward still fit together once split over the ranks?

A tensor-parallel plan can be right block by block and still break the model's forward: a
tensor the model computes once for every layer with one entry per head, a reshape into a fixed
number of head groups, a module that mixes all heads. Such a model fails only when it runs,
with a shape error deep inside. :func:`probe_forward` runs the model's forward once on fake
``input_ids`` (``FakeTensorMode``: shapes and dtypes only, no arithmetic, no memory), with the
schedule's collectives replaced by their effect on shapes (an all-gather concatenates, a
reduce-scatter narrows), and reports the innermost module that raised.

:func:`~schedlang.models.auto.apply_tensor_parallel` probes the model before writing its steps
and again after: a model that ran before and fails after is refused, and its steps are undone.
A model the probe cannot run in the first place (data-dependent shapes in a mixture-of-experts
router, say) is not refused: only ``Verify`` can tell then. Nor is a sequence-parallel plan probed:
the split of the sequence in front of the first layer is a function the shape-only run leaves out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import List, Optional

from torch import nn

__all__ = ["ProbeFailure", "probe_forward", "quiet_fake_tensors"]

logger = logging.getLogger("schedlang.models.shape_probe")


@dataclasses.dataclass
class ProbeFailure:
    """Where and how the fake forward failed: the innermost module running (its path, ``""`` for the root)."""

    path: str
    module_type: str
    error: str


def _first_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text if len(text) <= 240 else text[:237] + '...'}"


@contextlib.contextmanager
def quiet_fake_tensors():
    """torch logs, at error level with a traceback, every operator that fails on fake tensors, before it raises;
    where a failure is an answer (a probe, a shape the build tries on purpose) the raised error is enough."""
    fake_logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_logger.level
    fake_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_logger.setLevel(level)


def probe_forward(model: nn.Module) -> Optional[ProbeFailure]:
    """Run ``model(input_ids=...)`` once on fake tensors; None if it runs, else where it failed."""
    from ..graph import tracer as T

    stack: List[str] = []
    handles = []

    def leave(module, args, output):  # returns None: a forward hook's return value would replace the output
        if stack:
            stack.pop()

    # everything but the forward itself is prepared outside the try: a mistake there is a bug, not the model's answer
    forward = T.fake_ids_forward(model)
    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, path=path: stack.append(path) and None))
        handles.append(module.register_forward_hook(leave))
    try:
        with quiet_fake_tensors():
            forward()
        return None
    except Exception as e:  # the point of the probe: where the forward breaks
        path = stack[-1] if stack else ""
        module = model.get_submodule(path) if path else model
        logger.debug("shape probe of %s failed in %s: %s", type(model).__name__, path or "<root>", e)
        return ProbeFailure(path=path, module_type=type(module).__name__, error=_first_line(e))
    finally:
        for handle in handles:
            handle.remove()

"""Optimizers by name, for ``schedlang.build(sch, optimizer="adamw", lr=...)``."""

from __future__ import annotations

from schedlang.errors import ScheduleValueError
from schedlang.optim.adam import FusedAdam, FusedAdamW
from schedlang.optim.sgd import FusedSGD

__all__ = ["make_optimizer", "OPTIMIZERS"]

#: lower-case name -> fused optimizer class
OPTIMIZERS = {"adamw": FusedAdamW, "adam": FusedAdam, "sgd": FusedSGD}


def make_optimizer(name: str, params, **kwargs):
    """Build the fused optimizer called ``name`` ("adamw", "adam" or "sgd", any case).

    ``kwargs`` are the optimizer's own (lr, betas, weight_decay, momentum, ...).

    Example::

        opt = make_optimizer("AdamW", model.parameters(), lr=3e-4, weight_decay=0.1)
    """
    cls = OPTIMIZERS.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise ScheduleValueError(
            f"make_optimizer: unknown optimizer {name!r}: valid names are {', '.join(repr(n) for n in OPTIMIZERS)}")
    return cls(params, **kwargs)

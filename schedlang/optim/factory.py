"""Optimizers by name, for ``schedlang.build(sch, optimizer="adamw", lr=...)``."""

from __future__ import annotations

import inspect

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
    options = [n for n, p in inspect.signature(cls).parameters.items()
               if n != "params" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if k not in options]
    if unknown:  # Python's own TypeError would name the class's __init__, not the name the caller used
        raise ScheduleValueError(f"make_optimizer: {name!r} ({cls.__name__}) has no option "
                                 f"{', '.join(repr(k) for k in unknown)}: valid options are {', '.join(options)}")
    return cls(params, **kwargs)

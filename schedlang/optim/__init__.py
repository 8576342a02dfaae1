"""Fused multi-tensor optimizers: a few Triton launches update every parameter.

``FusedAdamW``, ``FusedAdam`` and ``FusedSGD`` are ``torch.optim.Optimizer`` subclasses with
torch.optim's arguments and state-dict layout; ``make_optimizer(name, params, **kw)`` builds
one by name. Triton is imported on the first ``step``, not here. ``FusedAdam(W)(...,
master_weights=True)`` keeps fp32 masters and turns the parameters into bf16 (or fp16) copies
(:mod:`schedlang.optim.master_weights`); ``master_weight_groups(model)`` makes that group of the
Linear weights only, which keeps autocast's numbers.

Example::

    import schedlang.optim
    opt = schedlang.optim.FusedAdamW(model.parameters(), lr=1e-3)
"""

from schedlang.optim.adam import FusedAdam, FusedAdamW
from schedlang.optim.factory import OPTIMIZERS, make_optimizer
from schedlang.optim.master_weights import master_weight_groups
from schedlang.optim.sgd import FusedSGD

__all__ = ["FusedAdam", "FusedAdamW", "FusedSGD", "make_optimizer", "OPTIMIZERS", "master_weight_groups"]

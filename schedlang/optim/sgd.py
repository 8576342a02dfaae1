"""Fused multi-tensor SGD (drop-in for ``torch.optim.SGD``).

Example::

    from schedlang.optim import FusedSGD
    opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
"""

from __future__ import annotations

import torch

from schedlang.errors import ScheduleValueError
from schedlang.optim.base import FusedOptimizer

__all__ = ["FusedSGD"]


def _as_float(x):
    return float(x) if isinstance(x, torch.Tensor) else x


class FusedSGD(FusedOptimizer):
    """SGD (momentum, dampening, Nesterov) as one multi-tensor Triton launch per bucket.

    Arguments are those of ``torch.optim.SGD``; ``foreach`` and ``fused`` are accepted and
    stored, ``differentiable=True`` is refused. The momentum buffer is an fp32 tensor under
    ``state["momentum_buffer"]`` (fp32, bf16 and fp16 parameters); ``lr`` may be a float or a
    1-element tensor read by the kernel (see :class:`~schedlang.optim.FusedAdam`).

    Example::

        opt = FusedSGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.1)
        model(x).sum().backward()
        opt.step()
    """

    _torch_name = "SGD"
    _state_tensor_keys = ("momentum_buffer",)

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach,
                        differentiable=differentiable, fused=fused)
        self._check_hyperparameters(defaults, "")
        super().__init__(params, defaults)

    def _check_group(self, group: dict, where: str) -> None:
        momentum, dampening = group["momentum"], group["dampening"]
        if not 0.0 <= momentum:
            raise ScheduleValueError(f"Invalid momentum value: {momentum}{where}: must be >= 0")
        if group["nesterov"] and (momentum <= 0 or dampening != 0):
            raise ScheduleValueError(
                f"Nesterov momentum requires a momentum and zero dampening{where}: got momentum={momentum}, "
                f"dampening={dampening}")
        if group.get("master_weights"):  # an option of the Adams; ignoring it would train without masters
            raise ScheduleValueError(f"master_weights: FusedSGD keeps no fp32 masters{where}; use FusedAdamW or "
                                     "FusedAdam for master weights, or drop the option")

    def _plan_flags(self, group: dict) -> tuple:
        return (_as_float(group["momentum"]) != 0,)

    def _checked_state_keys(self, group: dict) -> tuple:
        return ("momentum_buffer",) if _as_float(group["momentum"]) != 0 else ()

    def _states_of(self, group: dict):
        has_momentum = _as_float(group["momentum"]) != 0

        def states_of(p, states):
            if not has_momentum:
                return None, False
            state = states[p]
            buf = state.get("momentum_buffer")
            if buf is None:  # the kernel writes it (with the first gradient) before any read
                buf = state["momentum_buffer"] = torch.empty_like(
                    p, dtype=torch.float32, memory_format=torch.preserve_format)
                return buf, True
            return buf, False

        return states_of

    def _make_launcher(self, lists, tables):
        from schedlang.kernels.multi_tensor_sgd import SGDLauncher

        params, grads, buffers, fresh = lists
        has_momentum = buffers[0] is not None
        return SGDLauncher(params, grads, buffers if has_momentum else [], fresh, has_momentum=has_momentum,
                           tables=tables)

    def _launch(self, launcher, grads, group: dict, device: torch.device) -> None:
        launcher(grads, lr=self._lr_argument(group["lr"], device), momentum=_as_float(group["momentum"]),
                 dampening=_as_float(group["dampening"]), weight_decay=_as_float(group["weight_decay"]),
                 nesterov=group["nesterov"], maximize=group["maximize"])

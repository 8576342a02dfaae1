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

    def _step_group(self, group_index: int, group: dict, entries) -> None:
        from schedlang.kernels.multi_tensor_sgd import multi_tensor_sgd

        momentum = _as_float(group["momentum"])

        def states_of(p, state):
            if momentum == 0:
                return None, False
            buf = state.get("momentum_buffer")
            if buf is None:  # the kernel writes it (with the first gradient) before any read
                buf = state["momentum_buffer"] = torch.empty_like(
                    p, dtype=torch.float32, memory_format=torch.preserve_format)
                return buf, True
            return buf, False

        for key, (params, grads, buffers, fresh) in self._buckets(entries, states_of).items():
            device = key[0]
            multi_tensor_sgd(
                params, grads, buffers if momentum != 0 else [], fresh,
                lr=self._lr_argument(group["lr"], device), momentum=momentum,
                dampening=_as_float(group["dampening"]), weight_decay=_as_float(group["weight_decay"]),
                nesterov=group["nesterov"], maximize=group["maximize"],
                tables=self._chunk_tables((group_index,) + key))

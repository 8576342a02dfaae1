"""Fused multi-tensor Adam and AdamW (drop-in for ``torch.optim.Adam`` / ``torch.optim.AdamW``).

Example::

    from schedlang.optim import FusedAdamW
    opt = FusedAdamW(model.parameters(), lr=torch.tensor(3e-4, device="cuda"), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    loss.backward(); opt.step(); sched.step()
"""

from __future__ import annotations

import torch

from schedlang.errors import ScheduleTypeError, ScheduleValueError
from schedlang.optim.base import FusedOptimizer, fp32_state_like, local_tensor

__all__ = ["FusedAdam", "FusedAdamW"]


def _as_float(x):
    return float(x) if isinstance(x, torch.Tensor) else x


class FusedAdam(FusedOptimizer):
    """Adam whose step is one multi-tensor Triton launch per (param group, device, dtype).

    Arguments are those of ``torch.optim.Adam``. ``foreach``, ``fused`` and ``capturable`` are
    accepted and stored (the kernel is always fused and capturable); ``differentiable=True`` is
    refused. Parameters may be fp32, bf16 or fp16; the state (``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``) is fp32 and ``step`` a 0-d fp32 tensor on the parameter's device, under
    torch.optim's key names, so state dicts load both ways. ``lr`` may be a float or a 1-element
    tensor; a tensor on the parameters' device is read by the kernel, so changing it in place
    (an LR scheduler does) needs no recompilation, no host synchronization, and works between
    replays of a captured CUDA graph.

    Example::

        opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=1e-4, amsgrad=True)
        model(x).sum().backward()
        opt.step()
    """

    _torch_name = "Adam"
    _state_tensor_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _always_decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay or self._always_decoupled)
        self._check_hyperparameters(defaults, "")
        defaults["betas"] = tuple(_as_float(b) for b in betas)
        super().__init__(params, defaults)

    def _check_group(self, group: dict, where: str) -> None:
        eps, betas = group["eps"], group["betas"]
        if not 0.0 <= eps:
            raise ScheduleValueError(f"Invalid epsilon value: {eps}{where}: must be >= 0")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ScheduleTypeError(f"Invalid betas: {betas!r}{where}: expected a pair (beta1, beta2)")
        for i, beta in enumerate(betas):
            if isinstance(beta, torch.Tensor) and beta.numel() != 1:
                raise ScheduleValueError(f"Tensor betas[{i}] must be 1-element{where}")
            if not 0.0 <= beta < 1.0:
                raise ScheduleValueError(
                    f"Invalid beta parameter at index {i}: {_as_float(beta)}{where}: must be in [0, 1)")

    def _plan_flags(self, group: dict) -> tuple:
        return (bool(group["amsgrad"]),)

    def _checked_state_keys(self, group: dict) -> tuple:
        keys = ("exp_avg", "exp_avg_sq", "step")
        return keys + ("max_exp_avg_sq",) if group["amsgrad"] else keys

    def _states_of(self, group: dict):
        amsgrad = group["amsgrad"]

        def states_of(p, states):
            state = states[p]
            if "step" not in state:  # lazy initialization, on the first step with a gradient
                state["step"] = torch.zeros((), dtype=torch.float32, device=local_tensor(p).device)
                state["exp_avg"] = fp32_state_like(p)
                state["exp_avg_sq"] = fp32_state_like(p)
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = fp32_state_like(p)
            return state["exp_avg"], state["exp_avg_sq"], state["max_exp_avg_sq"] if amsgrad else None, state["step"]

        return states_of

    def _make_launcher(self, lists, tables):
        from schedlang.kernels.multi_tensor_adam import AdamLauncher

        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
        amsgrad = max_exp_avg_sqs[0] is not None
        return AdamLauncher(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], steps,
                            amsgrad=amsgrad, tables=tables)

    def _launch(self, launcher, grads, group: dict, device: torch.device) -> None:
        beta1, beta2 = group["betas"]
        launcher(grads, lr=self._lr_argument(group["lr"], device), beta1=_as_float(beta1), beta2=_as_float(beta2),
                 eps=_as_float(group["eps"]), weight_decay=_as_float(group["weight_decay"]),
                 maximize=group["maximize"],
                 decoupled_weight_decay=self._always_decoupled or bool(group.get("decoupled_weight_decay", False)))


class FusedAdamW(FusedAdam):
    """AdamW (decoupled weight decay) as one multi-tensor Triton launch per bucket.

    Arguments are those of ``torch.optim.AdamW`` (``weight_decay`` defaults to 1e-2); see
    :class:`FusedAdam` for dtypes, state layout and the learning-rate tensor.

    Example::

        opt = FusedAdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            opt.step()          # after a few eager steps, so that the state exists
        opt.param_groups[0]["lr"].fill_(5e-4); g.replay()
    """

    _torch_name = "AdamW"
    _always_decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=foreach, maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused, decoupled_weight_decay=True)

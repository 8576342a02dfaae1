"""Pure-PyTorch reference of :func:`schedlang.kernels.multi_tensor_adam.multi_tensor_adam`.

Same signature, same semantics, one tensor at a time: the update is computed in fp32 whatever
the parameter dtype (state is fp32), and the parameter is written back rounded to its dtype
(``Tensor.copy_`` rounds to nearest even). For fp32 parameters the operations are exactly
those of ``torch.optim.Adam``/``AdamW``'s single-tensor path (bias corrections in double
precision on the host), so this function is also the bridge that lets tests compare bf16
parameters: torch.optim keeps bf16 state for bf16 parameters and cannot serve as the reference
there. It is also what the optimizers run on CPU tensors when the Triton interpreter is off.

With ``masters`` (fp32 tensors, one per parameter) the update applies to the master in place
and the parameter receives the new master rounded to its dtype.

Example::

    multi_tensor_adam_reference([w], [w.grad], [m], [v], [], [step], lr=1e-3, beta1=0.9,
                                beta2=0.999, eps=1e-8, weight_decay=0.0)
"""

from __future__ import annotations

import math

import torch

__all__ = ["multi_tensor_adam_reference"]


@torch.no_grad()
def multi_tensor_adam_reference(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *,
                                lr, beta1: float, beta2: float, eps: float, weight_decay: float,
                                amsgrad: bool = False, maximize: bool = False,
                                decoupled_weight_decay: bool = False, masters=None, tables=None,
                                config: dict | None = None) -> None:
    """Reference Adam(W) step; ``tables`` and ``config`` are accepted and ignored."""
    lr = float(lr)  # a host read of a device tensor: fine for a reference
    for i, param in enumerate(params):
        step_t = state_steps[i]
        step_t += 1
        step = float(step_t)
        grad = grads[i].float()
        if maximize:
            grad = -grad
        # the fp32 master, or param itself when fp32: updated in place like torch.optim
        p = masters[i] if masters else param.float()
        if weight_decay != 0:
            if decoupled_weight_decay:
                p.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(p, alpha=weight_decay)
        exp_avg, exp_avg_sq = exp_avgs[i], exp_avg_sqs[i]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = math.sqrt(bias_correction2)
        if amsgrad:
            torch.maximum(max_exp_avg_sqs[i], exp_avg_sq, out=max_exp_avg_sqs[i])
            denom = (max_exp_avg_sqs[i].sqrt() / bias_correction2_sqrt).add_(eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-step_size)
        if p is not param:
            param.copy_(p)

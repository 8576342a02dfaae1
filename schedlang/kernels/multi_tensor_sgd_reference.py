"""Pure-PyTorch reference of :func:`schedlang.kernels.multi_tensor_sgd.multi_tensor_sgd`.

Same signature and semantics, one tensor at a time, in fp32 whatever the parameter dtype
(momentum buffers are fp32); the parameter is written back rounded to its dtype. For fp32
parameters these are exactly the operations of ``torch.optim.SGD``'s single-tensor path.

Example::

    multi_tensor_sgd_reference([w], [w.grad], [buf], [True], lr=0.1, momentum=0.9,
                               dampening=0.0, weight_decay=0.0)
"""

from __future__ import annotations

import torch

__all__ = ["multi_tensor_sgd_reference"]


@torch.no_grad()
def multi_tensor_sgd_reference(params, grads, momentum_buffers, fresh, *, lr, momentum: float,
                               dampening: float, weight_decay: float, nesterov: bool = False,
                               maximize: bool = False, tables=None, config: dict | None = None) -> None:
    """Reference SGD step; ``tables`` and ``config`` are accepted and ignored.

    ``fresh[i]`` says that ``momentum_buffers[i]`` was just allocated: it then takes the
    gradient as it is (torch.optim's first step), without momentum or dampening.
    """
    lr = float(lr)
    for i, param in enumerate(params):
        grad = grads[i].float()
        if maximize:
            grad = -grad
        p = param.float()
        if weight_decay != 0:
            grad = grad.add(p, alpha=weight_decay)
        if momentum != 0:
            buf = momentum_buffers[i]
            if fresh[i]:
                buf.copy_(grad)
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            if nesterov:
                grad = grad.add(buf, alpha=momentum)
            else:
                grad = buf
        p.add_(grad, alpha=-lr)
        if p is not param:
            param.copy_(p)

"""Helpers of the optimizer tests: twin parameter sets stepped side by side."""

import torch

SHAPES = [(7, 13), (1000,), (1,), (3, 5, 7)]


def twin_params(dtype=torch.float32, shapes=SHAPES):
    """Two independent copies of the same random parameters."""
    base = [torch.randn(s) for s in shapes]
    return ([p.clone().to(dtype).requires_grad_(True) for p in base],
            [p.clone().to(dtype).requires_grad_(True) for p in base])


def set_grads(*param_lists, skip=(), in_place=False):
    """Give each parameter (except the indices in ``skip``) the same fresh random gradient.

    ``in_place`` writes into the existing gradient tensors (same storage, as with
    ``zero_grad(set_to_none=False)``) instead of assigning new ones.
    """
    for i, ps in enumerate(zip(*param_lists)):
        if i in skip:
            continue
        g = torch.randn(ps[0].shape)
        for p in ps:
            if in_place and p.grad is not None:
                p.grad.copy_(g)
            else:
                p.grad = g.clone().to(p.dtype)


def assert_params_close(ours, ref, **tol):
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b.detach(), **tol)

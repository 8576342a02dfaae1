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


def step_side_by_side(steps, *params_and_optimizers):
    """``steps`` steps of every ``(params, optimizer)`` pair, each step with the same fresh gradients."""
    for _ in range(steps):
        set_grads(*(params for params, _ in params_and_optimizers))
        for _, optimizer in params_and_optimizers:
            optimizer.step()


def warm_up_then_copy(ref, ref_opt, ours, steps=3):
    """Step ``ref_opt`` alone (so that it has state to hand over), then give ``ours`` its values."""
    step_side_by_side(steps, (ref, ref_opt))
    with torch.no_grad():
        for a, b in zip(ours, ref):
            a.copy_(b)

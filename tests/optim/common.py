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


class WrapperTensor(torch.Tensor):
    """A tensor subclass holding its values in another tensor (as torchao's float8 weights do): its own
    ``data_ptr()`` is 0; every op runs on the inner tensor, and an in-place op changes it."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device,
                                                   requires_grad=inner.requires_grad)

    def __init__(self, inner):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, size, stride):
        return WrapperTensor(inner["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        def unwrap(t):
            return t.inner if isinstance(t, WrapperTensor) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func._schema.is_mutable and isinstance(args[0], WrapperTensor):
            return args[0]
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):  # nn.Parameter needs these
            return WrapperTensor(out)
        return out


def wrapped_twin_params(shapes=SHAPES, wrapped=(0, 2)):
    """Twin parameter sets whose first set has the parameters at ``wrapped`` as :class:`WrapperTensor`s."""
    ours, ref = twin_params(shapes=shapes)
    ours = [torch.nn.Parameter(WrapperTensor(p.detach().clone())) if i in wrapped else p for i, p in enumerate(ours)]
    return ours, ref


def plain_values(t: torch.Tensor) -> torch.Tensor:
    return t.inner if isinstance(t, WrapperTensor) else t.detach()

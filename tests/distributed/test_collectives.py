"""Autograd-aware collectives: forward values and gradients on 2 and 4 gloo ranks."""

import pytest
import torch

from schedlang.distributed import collectives as C
from schedlang.distributed.launch import run_distributed


def _check(rank, world):
    g = torch.Generator().manual_seed(7)
    full = torch.randn(world * 3, 5, generator=g)          # the same on every rank
    cot = torch.randn(world * 3, 5, generator=g)
    mine = full.chunk(world)[rank]
    # reduce_forward: sum of per-rank tensors; gradient passes through
    x = (full * (rank + 1)).requires_grad_(True)
    y = C.reduce_forward(x)
    torch.testing.assert_close(y, full * sum(range(1, world + 1)))
    y.backward(cot)
    torch.testing.assert_close(x.grad, cot)
    # reduce_backward: identity forward, summed gradient
    x = full.clone().requires_grad_(True)
    y = C.reduce_backward(x)
    (y * (rank + 1)).backward(cot)
    torch.testing.assert_close(x.grad, cot * sum(range(1, world + 1)))
    # gather_forward / scatter_forward are inverse
    x = mine.clone().requires_grad_(True)
    y = C.gather_forward(x, 0)
    torch.testing.assert_close(y, full)
    y.backward(cot)
    torch.testing.assert_close(x.grad, cot.chunk(world)[rank])
    x = full.clone().requires_grad_(True)
    y = C.scatter_forward(x, 0)
    torch.testing.assert_close(y, mine)
    y.backward(cot.chunk(world)[rank])
    torch.testing.assert_close(x.grad, cot)
    # reduce_scatter_forward: sum over ranks, keep my slice; gradient all-gathered
    x = (full * (rank + 1)).requires_grad_(True)
    y = C.reduce_scatter_forward(x, 0)
    torch.testing.assert_close(y, mine * sum(range(1, world + 1)))
    y.backward(cot.chunk(world)[rank])
    torch.testing.assert_close(x.grad, cot)
    # gathering along the last axis
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))
    assert C.gather_forward(x, -1).shape == (2, 3 * world)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_forward_and_backward(world):
    assert run_distributed(_check, world_size=world, timeout=120) == [True] * world


def test_collectives_are_identity_without_distributed():
    x = torch.randn(4, 3, requires_grad=True)
    for fn in (C.reduce_forward, C.reduce_backward):
        assert fn(x) is x
    for fn in (C.gather_forward, C.scatter_forward, C.reduce_scatter_forward):
        assert fn(x, 0) is x

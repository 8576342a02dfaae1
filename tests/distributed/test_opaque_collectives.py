"""schedlang::all_reduce_sum and the two Megatron conjugates built on it, eager and compiled, on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed


def _worker(rank, world):
    from schedlang.distributed import collectives as C
    from schedlang.distributed import opaque_collectives as O

    out = {}
    name = O.group_name(None)
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(5, 7, generator=g).t()  # not contiguous: the operator returns a contiguous sum
    expected = x.contiguous().clone()
    dist.all_reduce(expected)
    summed = torch.ops.schedlang.all_reduce_sum(x, name)
    out["sum"] = bool(torch.equal(summed, expected)) and summed.is_contiguous()
    out["input_kept"] = bool(torch.equal(x, torch.randn(5, 7, generator=torch.Generator().manual_seed(11 + rank)).t()))
    # the registered shape function and the autograd-free operator agree with what eager runs (torch's own checks)
    torch.library.opcheck(torch.ops.schedlang.all_reduce_sum.default, (torch.randn(3, 4), name),
                          test_utils=("test_schema", "test_faketensor"))

    def grads(fn, compiled: bool):
        w = torch.randn(7, 5, generator=torch.Generator().manual_seed(3 + rank), requires_grad=True)
        y = torch.randn(4, 7, generator=torch.Generator().manual_seed(5), requires_grad=True)

        def f(y, w):
            return (fn(y @ w) ** 2).sum()

        if compiled:
            f = torch.compile(f, backend="aot_eager", fullgraph=True)  # fullgraph: the collective is no break
        loss = f(y, w)
        loss.backward()
        return loss.detach(), y.grad, w.grad

    for key, opaque, reference in (("forward", lambda t: O.opaque_reduce_forward(t, name), C.reduce_forward),
                                   ("backward", lambda t: O.opaque_reduce_backward(t, name), C.reduce_backward)):
        ref = grads(reference, compiled=False)
        for mode in (False, True):
            got = grads(opaque, compiled=mode)
            out[key, mode] = max(float((a - b).abs().max()) for a, b in zip(got, ref))
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_worker, world_size=2, timeout=180)


def test_the_operator_is_the_eager_all_reduce_of_a_copy(runs):
    for r in runs:
        assert r["sum"] and r["input_kept"]


@pytest.mark.parametrize("which", ["forward", "backward"])
@pytest.mark.parametrize("compiled", [False, True])
def test_conjugates_match_the_eager_collectives_in_values_and_gradients(runs, which, compiled):
    for r in runs:
        assert r[which, compiled] <= 1e-5, r[which, compiled]

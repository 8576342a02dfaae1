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


def _every_sync_mode_and_op(rank, world):
    """Schedule.sync on an identity-like module, each (mode, op): values and input gradients."""
    import schedlang

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2.0

    g = torch.Generator().manual_seed(3)
    full = torch.randn(4 * world, 3, generator=g)          # identical on every rank
    mine = full.chunk(world)[rank]
    results = {}
    cases = [("fwd_pre", "all_reduce", {}), ("fwd_post", "all_reduce", {}), ("bwd_post", "all_reduce", {}),
             ("fwd_post", "all_gather", {"axis": 0}), ("fwd_pre", "reduce_scatter", {"axis": 0}),
             ("bwd_post", "all_gather", {"axis": 0}), ("bwd_post", "reduce_scatter", {"axis": 0})]
    for mode, op, kw in cases:
        sch = schedlang.create_schedule(Scale())
        sch.sync(mode, op, **kw)
        x_in = mine if (op, mode) in (("all_gather", "fwd_post"), ("reduce_scatter", "bwd_post")) else full
        x = (x_in * (rank + 1)).requires_grad_(True)
        y = sch.mod(x)
        y.backward(torch.ones_like(y))
        results[(mode, op)] = (tuple(y.shape), y.detach(), x.grad)
    s = sum(range(1, world + 1))
    # all_reduce: forward sums (fwd_pre / fwd_post), backward sums the gradient (bwd_post)
    torch.testing.assert_close(results[("fwd_pre", "all_reduce")][1], 2 * full * s)
    torch.testing.assert_close(results[("fwd_post", "all_reduce")][1], 2 * full * s)
    torch.testing.assert_close(results[("bwd_post", "all_reduce")][2], torch.full_like(full, 2.0 * world))
    # gathering the output in forward: every rank sees all slices
    assert results[("fwd_post", "all_gather")][0] == tuple(full.shape)
    # reduce-scatter of the input: this rank's slice of the sum
    torch.testing.assert_close(results[("fwd_pre", "reduce_scatter")][1], 2 * mine * s)
    # backward all-gather: forward keeps this rank's slice; the input gradient has the input's shape
    shape, y, grad = results[("bwd_post", "all_gather")]
    assert shape == tuple(mine.shape) and grad.shape == full.shape
    torch.testing.assert_close(y, 2 * mine * (rank + 1))
    torch.testing.assert_close(grad, torch.full_like(full, 2.0))
    # backward reduce-scatter: forward gathers; the gradient summed over ranks, this rank's slice
    shape, y, grad = results[("bwd_post", "reduce_scatter")]
    assert shape == tuple(full.shape) and grad.shape == mine.shape
    torch.testing.assert_close(grad, torch.full_like(mine, 2.0 * world))
    return True


def test_every_sync_mode_and_op_on_two_ranks():
    assert run_distributed(_every_sync_mode_and_op, world_size=2, timeout=120) == [True, True]


def _uneven_splits(rank, world):
    """Sizes the ranks cannot share equally, directly and at a schedule's sync point; then a collective that
    works, which every rank reaches only if none was left inside the refused one."""
    import schedlang

    messages = {}
    for name, call in [("reduce_scatter_forward", lambda: C.reduce_scatter_forward(torch.ones(3, 4), 0)),
                       ("scatter_forward", lambda: C.scatter_forward(torch.ones(4, 5), 1)),
                       ("reduce_scatter_tensor", lambda: C.reduce_scatter_tensor(torch.ones(3, 4), 0)),
                       ("local_slice", lambda: C.local_slice(torch.ones(3, 4), 0)),
                       ("axis", lambda: C.reduce_scatter_forward(torch.ones(4, 4), 2))]:
        try:
            call()
        except schedlang.SyncError as e:
            messages[name] = str(e)

    sch = schedlang.create_schedule(torch.nn.Sequential(torch.nn.Linear(8, 15), torch.nn.ReLU(),
                                                        torch.nn.Linear(15, 8)))
    sch["2"].sync("fwd_post", "reduce_scatter", axis=0)
    model, _ = schedlang.build(sch)
    try:
        model(torch.randn(3, 8))
    except schedlang.SyncError as e:
        messages["schedule"] = str(e)
    messages["after"] = tuple(model(torch.randn(4, 8)).shape)

    # the asynchronous form of the same sync point (what overlap_communication calls) checks the same way
    from schedlang.distributed.overlap import start_collective, start_sync, wait_sync

    sync = model[2]._schedlang_sync_fwd_post_0
    for name, call in [("start_sync", lambda: start_sync(sync, torch.ones(3, 8))),
                       ("start_collective", lambda: start_collective(torch.ones(5, 2), "reduce_scatter", 0))]:
        try:
            call()
        except schedlang.SyncError as e:
            messages[name] = str(e)
    messages["after_async"] = tuple(wait_sync(start_sync(sync, torch.ones(4, 8))).shape)
    return messages


def test_sizes_the_ranks_cannot_share_are_a_sync_error_on_every_rank():
    for m in run_distributed(_uneven_splits, world_size=2, timeout=120):
        assert m["reduce_scatter_forward"] == (
            "reduce_scatter_forward: cannot reduce-scatter dimension 0 of size 3 over 2 ranks (sync op "
            "'reduce_scatter' at fwd_pre or fwd_post): the size must be divisible by 2 (e.g. 2 or 4)")
        assert m["scatter_forward"] == (
            "scatter_forward: cannot split dimension 1 of size 5 over 2 ranks (the forward half of sync op "
            "'all_gather' at bwd_post): the size must be divisible by 2 (e.g. 4 or 6)")
        assert m["reduce_scatter_tensor"].startswith("reduce_scatter_tensor: cannot reduce-scatter dimension 0 of "
                                                     "size 3 over 2 ranks: the size must be divisible by 2")
        assert m["local_slice"].startswith("local_slice: cannot split dimension 0 of size 3 over 2 ranks")
        assert m["axis"] == ("reduce_scatter_forward: cannot reduce-scatter along axis 2 (sync op 'reduce_scatter' "
                             "at fwd_pre or fwd_post): the tensor has shape (4, 4), so valid axes are -2 to 1")
        # at a schedule's sync point the message names the module's path, and says so before any collective
        assert m["schedule"] == ("2: cannot reduce-scatter dimension 0 of size 3 over 2 ranks (sync op "
                                 "'reduce_scatter' at fwd_post): the size must be divisible by 2 (e.g. 2 or 4)")
        assert m["after"] == (2, 8)
        assert m["start_sync"] == m["schedule"]
        assert m["start_collective"] == ("start_collective: cannot reduce-scatter dimension 0 of size 5 over 2 "
                                         "ranks: the size must be divisible by 2 (e.g. 4 or 6)")
        assert m["after_async"] == (2, 8)

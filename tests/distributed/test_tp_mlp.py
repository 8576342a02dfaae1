"""Megatron-style tensor parallelism of an MLP on 2 gloo ranks."""

import pytest
import torch

import schedlang
from schedlang.distributed.launch import run_distributed
from tests.helpers.models import MLP


def _megatron(sch, path="", with_bwd_sync=True, with_fwd_sync=True):
    p = f"{path}." if path else ""
    sch[f"{p}fc1"].shard("weight", axis=0)
    sch[f"{p}fc1"].shard("bias", axis=0)
    sch[f"{p}fc2"].shard("weight", axis=1)
    if with_fwd_sync:
        sch[f"{p}fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    if with_bwd_sync:
        sch[f"{p}fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")


def _tp_numerics(rank, world, dtype_name):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)  # same weights on every rank
    model = MLP(hidden=10, inner=14).to(dtype)
    sch = schedlang.create_schedule(model)
    _megatron(sch)
    assert sch["fc1"].mod.out_features == 7 and sch["fc2"].mod.in_features == 7
    x = torch.randn(3, 5, 10, generator=torch.Generator().manual_seed(1)).to(dtype)
    xr, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    model(xr).pow(2).sum().backward()
    out = sch.mod(xs)
    out.pow(2).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out, model(xr), **tol)
    torch.testing.assert_close(xs.grad, xr.grad, **tol)
    s = slice(rank * 7, (rank + 1) * 7)
    torch.testing.assert_close(sch["fc1"].mod.weight.grad, model.fc1.weight.grad[s], **tol)
    torch.testing.assert_close(sch["fc1"].mod.bias.grad, model.fc1.bias.grad[s], **tol)
    torch.testing.assert_close(sch["fc2"].mod.weight.grad, model.fc2.weight.grad[:, s], **tol)
    torch.testing.assert_close(sch["fc2"].mod.bias.grad, model.fc2.bias.grad, **tol)
    return sch["fc1"].mod.weight.shape


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_megatron_mlp_matches_single_device(dtype_name):
    shapes = run_distributed(_tp_numerics, world_size=2, args=(dtype_name,), timeout=120)
    assert shapes == [torch.Size([7, 10])] * 2


def _verify_good_and_missing_reduce(rank, world):
    torch.manual_seed(rank)  # different weights per rank: Verify broadcasts rank 0's
    x = torch.randn(4, 10)
    sch = schedlang.create_schedule(MLP(hidden=10, inner=14))
    with schedlang.Verify(sch, example_inputs=[x]) as v:
        _megatron(sch)
    assert v.report.passed
    assert any("shard" in c and "fc2.weight" in c for c in v.report.compared)
    sch = schedlang.create_schedule(MLP(hidden=10, inner=14))
    try:
        with schedlang.Verify(sch, example_inputs=[x]):
            _megatron(sch, with_fwd_sync=False)
    except schedlang.VerificationError as e:
        return str(e)
    return None


def test_verify_passes_megatron_and_catches_missing_all_reduce():
    messages = run_distributed(_verify_good_and_missing_reduce, world_size=2, timeout=120)
    for rank, msg in enumerate(messages):
        assert msg is not None, f"rank {rank} did not raise"
        assert "output: max abs diff" in msg and "on rank 0" in msg and "on rank 1" in msg
        assert "#2 shard at 'fc2' (tensor_name='weight', axis=1)" in msg


def _missing_bwd_sync(rank, world):
    torch.manual_seed(0)
    sch = schedlang.create_schedule(MLP(hidden=10, inner=14))
    try:
        with schedlang.Verify(sch, example_inputs=[torch.randn(4, 10)]):
            _megatron(sch, with_bwd_sync=False)
    except schedlang.VerificationError as e:
        return str(e)
    return None


def test_verify_catches_missing_backward_all_reduce():
    for msg in run_distributed(_missing_bwd_sync, world_size=2, timeout=120):
        assert msg is not None and "input[0] gradient" in msg
        assert "output:" not in msg.split("steps applied")[0]


def _shard_not_divisible(rank, world):
    sch = schedlang.create_schedule(MLP(hidden=10, inner=15))
    try:
        sch["fc1"].shard("weight", axis=0)
    except schedlang.ShardError as e:
        return str(e)


def test_shard_size_not_divisible_by_world_size():
    for msg in run_distributed(_shard_not_divisible, world_size=2, timeout=60):
        assert msg == ("fc1: cannot shard 'weight' (shape (15, 10)) along axis 0: size 15 is not divisible by the "
                       "world size 2")


def _replay_on_every_rank(rank, world, plan_json):
    torch.manual_seed(0)
    model = MLP(hidden=10, inner=14)
    sch = schedlang.replay(plan_json, model)
    x = torch.randn(2, 10)
    torch.testing.assert_close(sch.mod(x), model(x), rtol=1e-5, atol=1e-5)
    return tuple(sch["fc1"].mod.weight.shape)


def test_plan_json_replays_on_every_rank():
    sch = schedlang.create_schedule(MLP(hidden=10, inner=14))
    _megatron(sch)
    shapes = run_distributed(_replay_on_every_rank, world_size=2, args=(sch.plan.to_json(),), timeout=120)
    assert shapes == [(7, 10), (7, 10)]


def _one_rank_hangs(rank, world):
    import torch.distributed as dist

    if rank == 1:
        import time

        time.sleep(60)
    t = torch.ones(1)
    dist.all_reduce(t)


def test_a_hung_rank_fails_with_a_timeout():
    with pytest.raises(schedlang.DistributedError, match=r"did not finish within 8 s"):
        run_distributed(_one_rank_hangs, world_size=2, timeout=8)

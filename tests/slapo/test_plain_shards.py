"""Where a shard lives after build: plain local shards without a mesh (Slapo's model), DTensors with one."""

import copy

import torch
import torch.distributed as dist
from torch import nn

import schedlang as slapo
from tests.helpers.distributed import run_distributed


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 14), nn.GELU(), nn.Linear(14, 6))


def _shard(sch):
    sch["0"].shard("weight", axis=0)
    sch["0"].shard("bias", axis=0)
    sch["0"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["2"].shard("weight", axis=1)
    sch["2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")


def _gathered(t, axis):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())  # refuses a DTensor: the shard must be a plain tensor
    return torch.cat(parts, dim=axis)


def _spawned(rank, world, path):
    from schedlang.distributed.dtensor_params import is_dtensor
    from schedlang.distributed.mesh import make_mesh
    from schedlang.errors import CheckpointError

    out = {}
    model = _model()
    sch = slapo.create_schedule(copy.deepcopy(model))
    _shard(sch)
    built, _ = slapo.build(sch)
    x = torch.randn(5, 10)
    built(x).square().sum().backward()
    model(x).square().sum().backward()
    out["plain"] = not any(is_dtensor(p) or is_dtensor(p.grad) for p in built.parameters())
    out["orig_shape"] = [tuple(built[0].weight.orig_shape), tuple(built[2].weight.orig_shape)]
    out["local_shape"] = tuple(built[0].weight.shape)
    for name, axis in (("0.weight", 0), ("0.bias", 0), ("2.weight", 1)):
        mine = dict(built.named_parameters())[name].grad
        ref = dict(model.named_parameters())[name].grad
        torch.testing.assert_close(_gathered(mine, axis), ref)
    try:
        slapo.save_checkpoint(path, built)
    except CheckpointError as e:
        out["save"] = str(e)

    with_mesh = slapo.create_schedule(copy.deepcopy(model), mesh=make_mesh(tp=world, device_type="cpu"))
    _shard(with_mesh)
    built_mesh, _ = slapo.build(with_mesh)
    out["dtensor"] = is_dtensor(built_mesh[0].weight) and is_dtensor(built_mesh[2].weight)
    slapo.save_checkpoint(path, built_mesh)  # a mesh-built model checkpoints as before
    return out


def test_without_a_mesh_shards_stay_plain_and_with_one_they_are_dtensors(tmp_path):
    results = run_distributed(_spawned, world_size=2, args=(str(tmp_path / "ckpt"),), timeout=180)
    for r in results:
        assert r["plain"] and r["dtensor"]
        assert r["orig_shape"] == [(14, 10), (6, 14)] and r["local_shape"] == (7, 10)
        # every rank refuses, and says which rank found what
        assert r["save"].startswith("rank 0: save_checkpoint: '0.weight' is a plain local shard (rank 0 of 2, of "
                                    "(14, 10)): the schedule was made without a mesh, so build kept its shards plain "
                                    "tensors, whose layout a checkpoint cannot record; create the schedule with a "
                                    "mesh (schedlang.create_schedule(model, mesh=make_mesh(tp=...))) to checkpoint it")
        assert "'0.weight' is a plain local shard (rank 1 of 2" in r["save"]

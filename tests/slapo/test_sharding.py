"""schedlang.sharding: Slapo's collectives (fwd + bwd on 2 gloo ranks against full-tensor references),
reshard schemes, shard-method descriptions, and the vocabulary-parallel cross entropy."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import schedlang as slapo
from schedlang.errors import ShardError, SyncError
from schedlang.sharding import shard_ops, sync_ops
from schedlang.sharding.reshard_ops import parse_reshard
from tests.helpers.distributed import run_distributed


def _full_and_grad(fn, x, grad):
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    out.backward(grad)
    return out.detach(), x.grad


def _two_ranks(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)  # the same "full" tensors on both ranks
    full = torch.randn(4, 6, 10, generator=gen, dtype=torch.float64)
    upstream = torch.randn(4, 6, 10, generator=gen, dtype=torch.float64)
    mine = lambda t, axis: t.chunk(world, axis)[rank]  # noqa: E731
    checks = {}

    # all-gather of local slices; consumer replicated: gradient = this rank's slice of the full gradient
    out, grad = _full_and_grad(lambda x: sync_ops.all_gather_forward_output(x, 2, group, False), mine(full, 2),
                               upstream)
    checks["gather"] = torch.equal(out, full) and torch.equal(grad, mine(upstream, 2))
    # consumer sharded: each rank's upstream gradient is a partial sum -> reduce-scatter
    out, grad = _full_and_grad(lambda x: sync_ops.all_gather_forward_output(x, 2, group, True), mine(full, 2),
                               upstream * (rank + 1))
    checks["gather_sharded_grad"] = torch.allclose(grad, mine(upstream * 3, 2))
    # reduce-scatter of partial sums: forward keeps this rank's slice of the sum
    out, grad = _full_and_grad(lambda x: sync_ops.reduce_scatter_forward_output(x, 1, group), full * (rank + 1),
                               mine(upstream, 1))
    checks["reduce_scatter"] = torch.allclose(out, mine(full * 3, 1)) and torch.equal(grad, upstream)
    out, grad = _full_and_grad(lambda x: sync_ops.scatter_forward_output(x, 0, group), full, mine(upstream, 0))
    checks["scatter"] = torch.equal(out, mine(full, 0)) and torch.equal(grad, upstream)
    out, grad = _full_and_grad(lambda x: sync_ops.reduce_forward_output(x, group), full * (rank + 1), upstream)
    checks["reduce_fwd"] = torch.allclose(out, full * 3) and torch.equal(grad, upstream)
    out, grad = _full_and_grad(lambda x: sync_ops.reduce_backward_grad(x, group), full, upstream * (rank + 1))
    checks["reduce_bwd"] = torch.equal(out, full) and torch.allclose(grad, upstream * 3)
    checks["plain"] = (torch.equal(sync_ops.all_gather_along_dim(mine(full, 1), 1, world, group), full)
                       and torch.allclose(sync_ops.reduce_scatter_along_dim(full, 2, world, group), mine(full * 2, 2))
                       and torch.equal(sync_ops.scatter_along_dim(full, 0, world, group), mine(full, 0)))
    # resharding: hidden-split (RS) <-> sequence-split (SR) <-> replicated, gradients back to the source layout
    rs, sr = mine(full, 2), mine(full, 1)
    out, grad = _full_and_grad(parse_reshard("RS->SR", group), rs, mine(upstream, 1))
    checks["RS->SR"] = torch.equal(out, sr)
    out2, grad2 = _full_and_grad(parse_reshard("SR->RS", group), sr, mine(upstream, 2))
    checks["SR->RS"] = torch.equal(out2, rs)
    checks["RS->RR"] = torch.equal(parse_reshard("RS->RR", group)(rs), full)
    checks["RR->SR"] = torch.equal(parse_reshard("RR->SR", group)(full), sr)
    # vocabulary-parallel cross entropy with label smoothing, against F.cross_entropy of the full logits
    logits = torch.randn(3, 5, 14, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 14, (3, 5), generator=gen)
    labels[0, 0] = -100
    weights = torch.rand(3, 5, generator=gen, dtype=torch.float64)
    loss_fn = slapo.op.ParallelCrossEntropy(group=group, label_smoothing=0.1)
    local = mine(logits, 2).clone().requires_grad_(True)
    (loss_fn(local, labels) * weights).sum().backward()
    ref = logits.clone().requires_grad_(True)
    ref_loss = F.cross_entropy(ref.view(-1, 14), labels.view(-1), reduction="none", label_smoothing=0.1).view(3, 5)
    (ref_loss * weights).sum().backward()
    local2 = mine(logits, 2).clone()
    checks["cross_entropy"] = (torch.allclose(loss_fn(local2, labels), ref_loss, atol=1e-10)
                               and torch.allclose(local.grad, mine(ref.grad, 2), atol=1e-10))
    # Slapo's set_random_seed with a tp_rank: different tensor-parallel masks, the same default stream
    slapo.set_random_seed(5, tp_rank=rank)
    with slapo.get_cuda_rng_tracker().fork():
        tp_mask = F.dropout(torch.ones(64), 0.5)
    default_mask = F.dropout(torch.ones(64), 0.5)
    masks = [torch.empty(64), torch.empty(64)], [torch.empty(64), torch.empty(64)]
    dist.all_gather(masks[0], tp_mask)
    dist.all_gather(masks[1], default_mask)
    checks["rng"] = not torch.equal(*masks[0]) and torch.equal(*masks[1])
    return checks


def test_sync_ops_reshard_cross_entropy_and_rng_on_two_ranks():
    results = run_distributed(_two_ranks, world_size=2, timeout=240)
    for rank, checks in enumerate(results):
        failed = [name for name, ok in checks.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


def test_single_process_collectives_are_identities_and_check_their_arguments():
    x = torch.randn(7, 13)
    assert sync_ops.all_gather_forward_output(x, 1, None) is x
    assert sync_ops.reduce_forward_output(x, None) is x
    with pytest.raises(SyncError, match=r"scatter_forward_output: dim 2 is out of range .* valid are -2 \.\. 1"):
        sync_ops.scatter_forward_output(x, 2, None)
    with pytest.raises(SyncError, match="reduce_scatter_along_dim: world_size=2 but the group has 1 ranks"):
        sync_ops.reduce_scatter_along_dim(x, 0, 2, None)
    with pytest.raises(SyncError, match="parse_reshard: unknown scheme 'RS->XX': valid are RR->RR"):
        parse_reshard("RS->XX", None)
    assert parse_reshard("RS->RS", None)(x) is x


def test_shard_methods_describe_output_types_and_keep_ties():
    sch = slapo.create_schedule(nn.Sequential(nn.Linear(8, 6), nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6)))
    assert shard_ops.dispatch_shard_method_cls(sch["0"]) is shard_ops.ShardLinear
    assert shard_ops.apply_shard_method("infer_output_type", sch["0"], "weight", 3, 0) == ("partition", -1)
    assert shard_ops.apply_shard_method("infer_output_type", sch["0"], "weight", 4, 1) == ("partial", None)
    assert shard_ops.apply_shard_method("infer_output_type", sch["1"], "weight", 2, 1) == ("partial", None)
    with pytest.raises(ShardError, match="BatchNorm2d shards along axis 0 .* only, got 1"):
        shard_ops.apply_shard_method("infer_output_type", sch["2"], "weight", 3, 1)
    with pytest.raises(ValueError, match="Linear already has ShardLinear"):
        shard_ops.register_shard_method(nn.Linear)(shard_ops.ShardMethod)
    tied = nn.Parameter(torch.randn(6, 8))
    first = shard_ops.new_or_get_tied_param(sch["0"], tied, torch.randn(3, 8))
    assert shard_ops.new_or_get_tied_param(sch["0"], tied, torch.randn(3, 8)) is first
    with pytest.raises(ShardError, match=r"already sharded to shape \(3, 8\), but this shard has shape \(6, 4\)"):
        shard_ops.new_or_get_tied_param(sch["0"], tied, torch.randn(6, 4))
    shard_ops.apply_sync_method(sch["0"], "fwd_post", "all_reduce")
    assert sch.plan[-1].primitive == "sync"

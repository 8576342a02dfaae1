"""DTensor and plain parameters in one fused optimizer (one gloo rank: DTensor's local shard
is the whole tensor), against torch.optim's single-tensor path."""

import pytest
import torch
import torch.distributed as dist

from schedlang.optim import FusedAdamW, FusedSGD

from .common import assert_params_close

pytest.importorskip("torch.distributed.tensor")


@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_dtensor_and_plain_params_together(mesh, kind):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    shapes = [(7, 13), (1000,), (3, 5, 7)]
    base = [torch.randn(s) for s in shapes]

    def make():
        # a DTensor, a plain tensor, and a plain "shard" of another shape than the full weight
        ps = [distribute_tensor(base[0].clone(), mesh, [Shard(0)]), base[1].clone(), base[2][:2].clone()]
        return [p.requires_grad_(True) for p in ps]

    ours, ref = make(), make()
    if kind == "adamw":
        opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    else:
        opt = FusedSGD(ours, lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(ref, lr=0.05, momentum=0.9, foreach=False)
    for _ in range(6):
        for a, b in zip(ours, ref):
            g = torch.randn(a.shape)
            if isinstance(a, DTensor):
                a.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
                b.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            else:
                a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert isinstance(ours[0], DTensor)
    key = "exp_avg" if kind == "adamw" else "momentum_buffer"
    assert isinstance(opt.state[ours[0]][key], DTensor)
    assert_params_close([p.to_local() if isinstance(p, DTensor) else p for p in ours],
                        [p.to_local() if isinstance(p, DTensor) else p for p in ref])
    # the state dict keeps DTensor state for DTensor parameters and loads into a fresh optimizer
    fresh = make()
    opt2 = type(opt)(fresh, **{k: v for k, v in opt.defaults.items() if k in ("lr", "momentum", "weight_decay")})
    opt2.load_state_dict(opt.state_dict())
    loaded = opt2.state[fresh[0]][key]
    assert isinstance(loaded, DTensor) and loaded.dtype == torch.float32
    assert torch.equal(loaded.to_local(), opt.state[ours[0]][key].to_local())

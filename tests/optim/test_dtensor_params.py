"""DTensor and plain parameters in one fused optimizer, against torch.optim: on one gloo rank (DTensor's local
shard is the whole tensor), and on two, with gradients laid out otherwise than their parameters."""

import copy

import pytest
import torch
import torch.distributed as dist

from schedlang.errors import ScheduleTypeError, ScheduleValueError
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


# -------------------------------------------------------------- gradients laid out otherwise than their parameter
# (parameter placement, gradient placement): torch's RowwiseParallel embedding gives its Shard(0) weight a Replicate
# gradient; a Partial gradient is a per-rank share of the sum; the last pair is the usual case
_LAYOUTS = [("shard0", "replicate"), ("shard0", "partial"), ("shard1", "replicate"), ("replicate", "partial"),
            ("shard0", "shard0")]
_FULL_SHAPE = (6, 10)  # rows and columns split evenly over 2 ranks


def _placement(name: str):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate(), "partial": Partial()}[name]


def _laid_out(full: torch.Tensor, mesh, name: str):
    """``full`` as a DTensor with placement ``name``; a Partial one holds a different share on each rank."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if name != "partial":
        return distribute_tensor(full.clone(), mesh, [_placement(name)])
    rank, world = dist.get_rank(), dist.get_world_size()
    share = full * (rank + 1) / (world * (world + 1) / 2)  # the ranks' shares add up to ``full``
    return DTensor.from_local(share, mesh, [_placement("partial")], run_check=False)


def _mismatched_layout_worker(rank, world, kind):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same values on every rank
    fulls = [torch.randn(_FULL_SHAPE) for _ in _LAYOUTS]
    ours = [_laid_out(f, mesh, p).requires_grad_(True) for f, (p, _) in zip(fulls, _LAYOUTS)]
    ref = [f.clone().requires_grad_(True) for f in fulls]
    if kind == "adamw":
        opt, ref_opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    else:
        opt, ref_opt = FusedSGD(ours, lr=0.05, momentum=0.9), torch.optim.SGD(ref, lr=0.05, momentum=0.9)
    for _ in range(3):
        grads = [torch.randn(_FULL_SHAPE) for _ in _LAYOUTS]
        for p, r, g, (_, g_layout) in zip(ours, ref, grads, _LAYOUTS):
            p.grad = _laid_out(g, mesh, g_layout)
            r.grad = g.clone()
        opt.step()
        ref_opt.step()
    for p, r, (p_layout, g_layout) in zip(ours, ref, _LAYOUTS):
        assert tuple(p.placements) == (_placement(p_layout),), "the parameter keeps its layout"
        torch.testing.assert_close(p.full_tensor(), r.detach(), msg=lambda m: f"{p_layout} / {g_layout}: {m}")
    # the gradients themselves are left as the backward made them
    assert [tuple(p.grad.placements) for p in ours] == [(_placement(g),) for _, g in _LAYOUTS]


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_gradient_laid_out_otherwise_than_its_parameter_updates_the_right_shard(kind):
    """Each rank's shard must be updated from its own rows of the gradient: read as it is, the local tensor
    of a replicated gradient would give every rank the first rows, and a partial one its share of the sum."""
    from tests.helpers.distributed import run_distributed

    run_distributed(_mismatched_layout_worker, world_size=2, args=(kind,), timeout=120)


def test_a_dtensor_gradient_on_a_plain_parameter_is_refused(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    p = torch.randn(4, 3, requires_grad=True)
    p.grad = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    opt = FusedSGD([p], lr=0.1)
    before = p.detach().clone()
    with pytest.raises(ScheduleTypeError, match=r"parameter 0 of param group 0 is a plain tensor .* a DTensor"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_a_gradient_on_another_mesh_is_refused(mesh):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    p = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]).requires_grad_(True)
    p.grad = distribute_tensor(torch.randn(4, 3), init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)), [Shard(0)])
    opt = FusedAdamW([p], lr=1e-2)
    before = p.to_local().clone()
    with pytest.raises(ScheduleValueError, match=r"FusedAdamW: the gradient of parameter 0 of param group 0 lives on "
                                                 r"mesh .* a gradient must be on its parameter's mesh"):
        opt.step()
    assert torch.equal(p.to_local(), before) and not opt.state[p]


def test_a_plain_gradient_on_a_dtensor_parameter_is_refused(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    p = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]).requires_grad_(True)
    p.grad = torch.randn(4, 3)
    opt = FusedAdamW([p], lr=1e-2)
    before = p.to_local().clone()
    with pytest.raises(ScheduleTypeError, match=r"parameter 0 of param group 0 is a DTensor .* plain tensor"):
        opt.step()
    assert torch.equal(p.to_local(), before) and not opt.state[p]


def _vocab_parallel_embedding_worker(rank, world):
    """torch's own vocabulary-parallel embedding (``RowwiseParallel`` on an ``nn.Embedding``, as torchtitan's
    plan has it): its Shard(0) weight gets a Replicate gradient."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(14, 6), nn.Linear(6, 5))
    model = parallelize_module(copy.deepcopy(ref), mesh,
                               {"0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())})
    opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        ids = torch.randint(0, 14, (3, 7), generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(ids).square().mean().backward()
            o.step()
    assert model[0].weight.placements == (Shard(0),)
    assert model[0].weight.grad.placements == (Replicate(),), "torch's layout this test is about"
    torch.testing.assert_close(model[0].weight.full_tensor(), ref[0].weight.detach())
    torch.testing.assert_close(model[1].weight.detach(), ref[1].weight.detach())


def test_torchs_vocabulary_parallel_embedding_trains_as_one_process():
    from tests.helpers.distributed import run_distributed

    run_distributed(_vocab_parallel_embedding_worker, world_size=2, timeout=120)


def _sequence_parallel_worker(rank, world):
    """torch's ``SequenceParallel`` norm (torchtitan's plan): its Replicate weight and bias get Partial gradients,
    each rank's share of the sum over the sequence it holds."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 12), nn.Linear(12, 8)

        def forward(self, x):
            return self.down(torch.relu(self.up(self.norm(x))))

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = Block()
    model = parallelize_module(copy.deepcopy(ref), mesh, {
        "norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1))})
    opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        ref_opt.zero_grad()
        # SequenceParallel takes each rank's part of the sequence (3 of the 6 positions); the losses of the
        # ranks' parts add up to the whole sequence's
        model(x[:, 3 * rank:3 * (rank + 1)]).square().sum().backward()
        ref(x).square().sum().backward()
        opt.step()
        ref_opt.step()
    assert model.norm.weight.grad.placements == (Partial(),), "torch's layout this test is about"
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), r.detach(), msg=lambda m: f"{name}: {m}")
    # every rank holds the same norm weights (each stepped from the whole sum, not its own share)
    mine = model.norm.weight.to_local().clone()
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


def test_torchs_sequence_parallel_norm_trains_as_one_process():
    from tests.helpers.distributed import run_distributed

    run_distributed(_sequence_parallel_worker, world_size=2, timeout=120)

"""Asynchronous collectives on 2 gloo ranks: the overlapped graph computes what the blocking one does."""

import copy
import math
import operator

import torch
import torch.distributed as dist
from torch import fx, nn

import schedlang
from schedlang.distributed.overlap import start_collective, wait_sync
from schedlang.distributed.sync_ops import SyncOp
from schedlang.graph.passes.overlap_communication import overlap_communication
from tests.helpers.distributed import run_distributed
from tests.helpers.models import MLP


class TwoPaths(nn.Module):
    """A tensor-parallel MLP next to an independent branch that can run during its all-reduce."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP(hidden=10, inner=14)
        self.side = nn.Linear(10, 10)

    def forward(self, x):
        return self.mlp(x) + torch.tanh(self.side(x)) * 2


class _SyncLeaf(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, SyncOp) or super().is_leaf_module(m, qualname)


class Explicit(nn.Module):
    """SyncOp children called in forward: all-gather, reduce-scatter, all-reduce."""

    def __init__(self, replicated):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(6, 8)
        self.gather = SyncOp("fwd_post", "all_gather", axis=-1, grad_is_replicated=replicated)
        self.scatter = SyncOp("fwd_post", "reduce_scatter", axis=0)
        self.reduce = SyncOp("fwd_pre", "all_reduce")

    def forward(self, x, y):
        g = self.gather(self.a(x))  # (4, 16)
        s = self.scatter(self.b(y))  # (2, 8)
        independent = torch.sigmoid(y) * 3
        r = self.reduce(independent.sum(0, keepdim=True))
        return g.sum(-1, keepdim=True) * r.mean() + s.sum() + independent.mean()


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        h = self.fc(x) * 2
        view = h.view(-1)
        dist.all_reduce(h)  # in place
        z = torch.tanh(x) + 1  # independent of h
        return view.sum() + z


def _grads(model, inputs):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    out.pow(2).sum().backward()
    params = {n: p.grad for n, p in model.named_parameters()}
    return out.detach(), [t.grad for t in inputs], params


def _same(model_a, model_b, inputs, backward=True):
    if not backward:
        with torch.no_grad():
            torch.testing.assert_close(model_b(*inputs), model_a(*inputs), rtol=1e-6, atol=1e-6)
        return
    out_a, in_a, par_a = _grads(model_a, inputs)
    out_b, in_b, par_b = _grads(model_b, inputs)
    torch.testing.assert_close(out_b, out_a, rtol=1e-6, atol=1e-6)
    for a, b in zip(in_a, in_b):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    assert par_a.keys() == par_b.keys()
    for k in par_a:
        torch.testing.assert_close(par_b[k], par_a[k], rtol=1e-6, atol=1e-6)


def _overlap_numerics(rank, world):
    summary = {}
    gen = torch.Generator().manual_seed(10 + rank)  # different data on every rank

    # 1. Megatron MLP through a schedule; the all-reduce after fc2 overlaps the side branch
    torch.manual_seed(0)
    model = TwoPaths()
    sch = schedlang.create_schedule(model)
    sch["mlp.fc1"].shard("weight", axis=0)
    sch["mlp.fc1"].shard("bias", axis=0)
    sch["mlp.fc2"].shard("weight", axis=1)
    sch["mlp.fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["mlp.fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch.trace(flatten=True)
    blocking = copy.deepcopy(sch.mod)
    report = sch._run("overlap_communication")
    code = sch.mod.code
    assert code.index("start_sync") < code.index("self.side(") < code.index("wait_sync"), code
    x = torch.randn(3, 5, 10, generator=torch.Generator().manual_seed(1))  # same input everywhere (TP)
    _same(blocking, sch.mod, [x])
    out = sch.mod(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)  # and equal to the unsharded model
    summary["megatron"] = [(r.kind, r.between) for r in report.records]

    # 2. explicit SyncOp nodes: all-gather (both gradient conventions), reduce-scatter, all-reduce
    for replicated in (True, False):
        torch.manual_seed(1)
        module = Explicit(replicated)
        gm = fx.GraphModule(module, _SyncLeaf().trace(module))
        blocking = copy.deepcopy(gm)
        report = overlap_communication(gm)
        inputs = [torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)]
        _same(blocking, gm, inputs)
        summary[f"explicit_replicated={replicated}"] = sorted(r.kind for r in report.records)

    # 3. an in-place torch.distributed call recorded in the graph
    torch.manual_seed(2)
    module = InPlace()
    tracer = fx.Tracer(autowrap_modules=(math, torch.distributed))
    gm = fx.GraphModule(module, tracer.trace(module))
    blocking = copy.deepcopy(gm)
    report = overlap_communication(gm)
    code = gm.code
    assert "async_op = True" in code and code.index("tanh") < code.index("wait_work"), code
    _same(blocking, gm, [torch.randn(3, 5, generator=gen)], backward=False)
    summary["in_place"] = [(r.kind, r.between) for r in report.records]

    # 4. a functional collective: its wait_tensor moves down to the first use
    graph = fx.Graph()
    x = graph.placeholder("x")
    started = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", dist.group.WORLD.group_name))
    waited = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (started,))
    side = graph.call_function(torch.tanh, (x,))
    side = graph.call_function(operator.mul, (side, 3))
    graph.output(graph.call_function(operator.add, (waited, side)))
    gm = fx.GraphModule(nn.Module(), graph)
    blocking = copy.deepcopy(gm)
    report = overlap_communication(gm)
    order = [n.target for n in gm.graph.nodes]
    assert order.index(operator.mul) < order.index(torch.ops._c10d_functional.wait_tensor.default), gm.code
    _same(blocking, gm, [torch.randn(4, 3, generator=gen)], backward=False)
    summary["functional"] = [(r.kind, r.between) for r in report.records]

    # 5. the wrappers directly, with a wait long after the start
    t = torch.randn(6, 4, generator=gen)
    pending = start_collective(t, "all_gather", 0)
    busy = sum(torch.randn(64, 64).sum() for _ in range(5))
    gathered = wait_sync(pending)
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    torch.testing.assert_close(gathered, torch.cat(parts, 0))
    assert torch.isfinite(busy)
    return summary


def test_overlapped_collectives_match_blocking_ones_on_two_ranks():
    summaries = run_distributed(_overlap_numerics, world_size=2, timeout=180)
    assert summaries[0] == summaries[1]
    s = summaries[0]
    assert s["megatron"] == [("all_reduce", 3)]  # side linear, tanh and mul run during the all-reduce
    assert s["explicit_replicated=True"] == ["all_gather", "all_reduce", "reduce_scatter"]
    assert s["in_place"] == [("all_reduce", 2)]
    assert s["functional"] == [("wait_tensor", 2)]

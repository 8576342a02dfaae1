"""``replace(new, target_ops=subgraphs)`` and ``checkpoint(subgraph)`` on found subgraphs."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import schedlang
from schedlang.errors import ScheduleValueError
from schedlang.graph import CheckpointedSubgraph
from schedlang.module_record import module_record


class _Attention(nn.Module):
    def __init__(self, hidden=16, heads=4):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)

    def split(self, t):
        return t.view(t.shape[:-1] + (self.heads, -1)).permute(0, 2, 1, 3)

    def forward(self, x):
        q, k, v = self.split(self.q_proj(x)), self.split(self.k_proj(x)), self.split(self.v_proj(x))
        y = F.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1) @ v
        return self.out(y.permute(0, 2, 1, 3).flatten(2))


class _FusedQKV(nn.Module):
    """One GEMM for q, k and v, returning them split into heads, as three outputs."""

    def __init__(self, attn: _Attention):
        super().__init__()
        self.heads = attn.heads
        self.qkv = nn.Linear(16, 48)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
            self.qkv.bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return [t.view(t.shape[:-1] + (self.heads, -1)).permute(0, 2, 1, 3) for t in (q, k, v)]


def _qkv_pattern(x):
    y = schedlang.call_module(r"[qkv]_proj", x)
    return y.view(y.shape[:-1] + (4, -1)).permute(0, 2, 1, 3)


def _check(model, module, x):
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, out = model(xr), module(xs)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    out.backward(grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-5, atol=1e-5)


def test_horizontal_replacement_returns_the_outputs_in_order():
    model = _Attention()
    sch = schedlang.create_schedule(model)
    sch.trace()
    found = sch.find(_qkv_pattern)
    assert len(found) == 3
    sch.replace(_FusedQKV(model), target_ops=found)
    calls = [n.target for n in sch.mod.graph.nodes if n.op == "call_module"]
    assert calls == ["_FusedQKV_0", "out"]
    # the three projections were only used inside the subgraphs: gone, with their weights
    assert not any(k.startswith(("q_proj", "k_proj", "v_proj")) for k in sch.mod.state_dict())
    _check(model, sch.mod, torch.randn(3, 5, 16))
    assert [s.primitive for s in sch.plan] == ["trace", "replace"]


def test_regex_results_replace_as_one_call_with_a_given_name():
    model = _Attention()
    sch = schedlang.create_schedule(model)
    sch.trace()

    class Projections(nn.Module):
        def __init__(self):
            super().__init__()
            # the schedule's own projections: the user's would be changed by whatever the schedule does next
            self.q, self.k, self.v = sch.mod.q_proj, sch.mod.k_proj, sch.mod.v_proj

        def forward(self, x):
            return self.q(x), self.k(x), self.v(x)

    sch.replace(Projections(), target_ops=sch.find(r"^[qkv]_proj$"), name="qkv")
    assert "qkv_0" in dict(sch.mod.named_children())
    _check(model, sch.mod, torch.randn(2, 7, 16))


def test_vertical_replacement_by_a_module_and_by_a_function():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x * torch.sigmoid(x))

    model = Block()
    sch = schedlang.create_schedule(model)
    sch.trace()
    sch.replace(nn.SiLU(), target_ops=sch.find(lambda x: x * torch.sigmoid(x)))
    assert [n.target for n in sch.mod.graph.nodes if n.op == "call_module"] == ["SiLU_0", "fc"]
    _check(model, sch.mod, torch.randn(4, 8))

    sch = schedlang.create_schedule(model)
    sch.trace()
    sch.replace(F.silu, target_ops=sch.find(lambda x: x * torch.sigmoid(x)))
    assert any(n.target is F.silu for n in sch.mod.graph.nodes)
    _check(model, sch.mod, torch.randn(4, 8))
    with pytest.raises(schedlang.PlanSerializationError):  # a function object cannot be written to JSON
        sch.plan.to_json()


def test_replace_errors():
    model = _Attention()
    sch = schedlang.create_schedule(model)
    sch.trace()
    found = sch.find(_qkv_pattern)
    with pytest.raises(ScheduleValueError, match=r"^<root>: Linear\(input: torch.Tensor\) -> torch.Tensor cannot be "
                                                 r"called with the 2 input\(s\) of the subgraph\(s\) "
                                                 r"\(permute, transpose\): "
                                                 r"too many positional arguments$"):
        sch.replace(nn.Linear(4, 4), target_ops=[("", "matmul")])
    with pytest.raises(ScheduleValueError, match=r"^<root>: replace of subgraph 0 would create a cycle: 'q_proj' "
                                                 r"feeds 'getattr_1' outside the subgraph, which feeds 'view' inside"):
        sch.replace(nn.Identity(), target_ops=_two_nodes_around_a_shape(sch))
    code = sch.mod.code
    with pytest.raises(ScheduleValueError, match=r"^<root>: replace name must be a Python identifier"):
        sch.replace(nn.Identity(), target_ops=found[0], name="a.b")
    assert sch.mod.code == code
    model2 = _Attention()
    sch2 = schedlang.create_schedule(model2)
    sch2["q_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch2.trace()
    with pytest.raises(ScheduleValueError, match=r"^<root>: cannot replace 'q_proj': module 'q_proj' has hooks or "
                                                 r"sync points, which the replacement would drop"):
        sch2.replace(nn.Identity(), target_ops=sch2.find("q_proj"))


def _two_nodes_around_a_shape(sch):
    """``q_proj`` and the ``view`` using it, without the shape computed from q_proj in between."""
    q = next(n for n in sch.mod.graph.nodes if n.name == "q_proj")
    view = next(u for u in q.users if u.target == "view")
    return [("", q), ("", view)]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.calls = 0

    def forward(self, x):
        h = self.fc1(x)
        h = torch.tanh(h) * torch.sigmoid(h)
        return self.fc2(h)


def test_checkpointed_subgraph_recomputes_in_backward_and_keeps_names():
    model = _Net()
    sch = schedlang.create_schedule(model)
    sch.trace()
    found = sch.find(lambda h: torch.tanh(h) * torch.sigmoid(h))
    sch.checkpoint(found)
    wrapper = sch["CheckPointWrapper_0"].mod
    assert isinstance(wrapper, CheckpointedSubgraph) and module_record(wrapper).checkpointed
    assert list(sch.mod.state_dict()) == list(model.state_dict())
    runs = []
    wrapper.body.register_forward_pre_hook(lambda m, a: runs.append(1))
    _check(model, sch.mod, torch.randn(5, 8))
    assert len(runs) == 2  # forward, then recomputed in backward
    with torch.no_grad():
        sch.mod(torch.randn(2, 8))
    assert len(runs) == 3


def test_checkpointed_subgraph_with_modules_and_parameters_inside():
    model = _Net()
    sch = schedlang.create_schedule(model)
    sch.trace()
    nodes = [("", n) for n in sch.mod.graph.nodes if n.op in ("call_module", "call_function")]
    sch.checkpoint(nodes[:-1])  # fc1, tanh, sigmoid, mul
    assert sch.mod.fc1 is sch["CheckPointWrapper_0"].mod.body.fc1  # still registered at its old path
    assert list(sch.mod.state_dict()) == list(model.state_dict())
    _check(model, sch.mod, torch.randn(6, 8))
    grads = [p.grad for p in sch.mod.parameters()]
    assert all(g is not None for g in grads)
    replayed = schedlang.replay(sch.plan.to_json(), _Net())
    assert replayed.mod.code == sch.mod.code

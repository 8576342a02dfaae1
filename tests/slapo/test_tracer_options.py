"""Slapo's tracer options: ``tracer="pytorch"`` / ``"huggingface"`` (torch.fx's input rule), ``config=``,
leaf modules named by class, and ``torch.finfo`` of a traced tensor's dtype."""

import pytest
import torch
import torch.fx as fx
from torch import nn

import schedlang as slapo
from schedlang.errors import TraceError


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x, mask=None, scale=1.0, flag=False):
        out = self.proj(x) * scale
        if mask is not None:
            out = out + mask
        return -out if flag else out


def _placeholders(gm):
    return [n.target for n in gm.graph.nodes if n.op == "placeholder"]


@pytest.mark.parametrize("tracer", ["pytorch", "huggingface"])
def test_arguments_left_out_of_concrete_args_are_inputs_in_signature_order(tracer):
    model = Gate()
    sch = slapo.create_schedule(model)
    sch.trace(tracer=tracer, concrete_args={"flag": False, "scale": 2.0})
    assert isinstance(sch.mod, fx.GraphModule)
    assert _placeholders(sch.mod)[:2] == ["x", "mask"]
    x, mask = torch.randn(3, 6), torch.randn(3, 6)
    torch.testing.assert_close(sch.mod(x, mask, scale=2.0), model(x, mask, scale=2.0))
    # the mask is an input: the graph took the branch that adds it, and keeps taking it
    torch.testing.assert_close(sch.mod(x, torch.zeros(3, 6), scale=2.0), model(x, scale=2.0))


def test_fx_tracer_keeps_defaults_of_arguments_left_out():
    model = Gate()
    sch = slapo.create_schedule(model)
    sch.trace(tracer="fx", concrete_args={"flag": False})
    x = torch.randn(3, 6)
    torch.testing.assert_close(sch.mod(x), model(x))
    # mask kept its default None: the graph has no add, and passing a mask is refused
    with pytest.raises(TraceError, match="mask"):
        sch.mod(x, torch.randn(3, 6))


class Heads(nn.Module):
    """Branches on the sequence length and takes a mask value from the dtype, as HF attention does."""

    def __init__(self, hidden=8):
        super().__init__()
        self.q = nn.Linear(hidden, hidden)

    def forward(self, hidden_states):
        scores = self.q(hidden_states).float() @ hidden_states.float().transpose(-1, -2)
        if hidden_states.shape[1] > 1:
            causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        return scores.softmax(-1)


def test_config_shapes_the_example_of_hidden_states():
    from transformers import GPT2Config

    model = Heads()
    sch = slapo.create_schedule(model)
    with pytest.raises(TraceError, match="hidden_states"):  # no example: the branch cannot be decided
        sch.trace(tracer="huggingface", concrete_args={})
    sch.trace(tracer="huggingface", concrete_args={}, config=GPT2Config(n_embd=8, n_head=2))
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(sch.mod(x), model(x))
    # the config travels in the plan: the replayed trace takes the same branch
    replayed = slapo.replay(sch.plan.to_json(), Heads())
    torch.testing.assert_close(replayed.mod(x), replayed.mod(x))
    assert isinstance(replayed.mod, fx.GraphModule)


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu()


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Inner()
        self.b = Inner()
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.b(self.a(x)))


def test_leaf_modules_named_by_class():
    model = Outer()
    sch = slapo.create_schedule(model)
    sch.trace(flatten=True, leaf_modules=["Inner"])
    calls = [n.target for n in sch.mod.graph.nodes if n.op == "call_module"]
    assert calls == ["a", "b", "out"]
    x = torch.randn(3, 4)
    torch.testing.assert_close(sch.mod(x), model(x))

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import schedlang
from tests.helpers.models import MLP, Stack


class FusedMLP(nn.Module):
    """Same function as MLP, written differently."""

    def __init__(self, mlp: MLP):
        super().__init__()
        self.w1 = nn.Parameter(mlp.fc1.weight.detach().clone())
        self.b1 = nn.Parameter(mlp.fc1.bias.detach().clone())
        self.w2 = nn.Parameter(mlp.fc2.weight.detach().clone())
        self.b2 = nn.Parameter(mlp.fc2.bias.detach().clone())

    def forward(self, x):
        return F.linear(F.gelu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)


def test_replace_module_keeps_numerics_and_is_recorded():
    model = Stack()
    sch = schedlang.create_schedule(model)
    new = FusedMLP(sch["layers.0.mlp"].mod)
    sch["layers.0.mlp"].replace(new)
    assert sch["layers.0.mlp"].mod is new
    x = torch.randn(3, 12)
    model.eval(); sch.mod.eval()
    torch.testing.assert_close(sch.mod(x), model(x))
    assert "replace" in str(sch.plan) and "<FusedMLP>" in str(sch.plan)


def test_replay_uses_module_as_it_was_passed():
    sch = schedlang.create_schedule(MLP())
    new = nn.Linear(12, 20)
    sch["fc1"].replace(new)
    sch["fc1"].shard("weight", axis=0)
    replayed = schedlang.replay(sch.plan, MLP())
    assert replayed["fc1"].mod is not new
    torch.testing.assert_close(replayed["fc1"].mod.weight, new.weight)


def test_replace_errors():
    sch = schedlang.create_schedule(MLP())
    with pytest.raises(schedlang.ScheduleTypeError, match=r"fc1: replacing a whole module needs an nn.Module instance, "
                       r"got function; a function can only replace subgraphs"):
        sch["fc1"].replace(lambda x: x)
    with pytest.raises(schedlang.ScheduleValueError, match=r"fc1: the new module is the module already there"):
        sch["fc1"].replace(sch["fc1"].mod)
    with pytest.raises(schedlang.ScheduleValueError, match=r"fc1: name= only applies when replacing subgraphs"):
        sch["fc1"].replace(nn.Identity(), name="x")
    assert len(sch.plan) == 0


def test_replace_root():
    sch = schedlang.create_schedule(MLP())
    sch.replace(nn.Identity())
    assert isinstance(sch.mod, nn.Identity)

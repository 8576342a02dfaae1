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


def test_replace_refuses_a_module_of_the_users_model():
    # put in the schedule as it is, it would let every later step change the user's model through it
    from tests.helpers.models import assert_unchanged, state_snapshot

    model = Stack()
    before = state_snapshot(model)
    sch = schedlang.create_schedule(model)
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"^layers.0.mlp.fc1: replace got a Linear that is the module at 'layers.1.mlp.fc1' of "
                             r"the model given to create_schedule; the schedule works on a copy and must never change "
                             r"your model: pass sch\['layers.1.mlp.fc1'\].mod \(the schedule's copy\) or "
                             r"copy.deepcopy\(...\) of it$"):
        sch["layers.0.mlp.fc1"].replace(model.layers[1].mlp.fc1)
    with pytest.raises(schedlang.ScheduleValueError, match=r"replace got a Sequential \(its submodule '1'\) that is "
                                                           r"the module at 'layers.0.mlp.act'"):
        sch["layers.0.mlp.act"].replace(nn.Sequential(nn.Identity(), model.layers[0].mlp.act))
    shared = nn.Linear(12, 20)
    shared.weight = model.layers[0].mlp.fc1.weight
    with pytest.raises(schedlang.ScheduleValueError, match=r"^layers.0.mlp.fc1: replace got a Linear whose tensor "
                                                           r"'weight' is 'layers.0.mlp.fc1.weight' of the model given "
                                                           r"to create_schedule; training the schedule would change "
                                                           r"your model"):
        sch["layers.0.mlp.fc1"].replace(shared)
    assert len(sch.plan) == 0
    sch["layers.0.mlp.fc1"].replace(sch["layers.1.mlp.fc1"].mod)  # the schedule's own copy may be shared
    sch["layers.0.mlp.fc1"].shard("weight", axis=0)
    sch["layers.0.mlp.fc1"].sync("fwd_post", "all_reduce")
    assert_unchanged(model, before)


def test_replace_refuses_a_module_that_would_contain_itself():
    sch = schedlang.create_schedule(Stack())
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"^layers.0.mlp.fc1: replace cannot put this Block at 'layers.0.mlp.fc1': it is the module "
                             r"at 'layers.0', which would then contain itself; pass a new module, or "
                             r"copy.deepcopy\(...\) of that one$"):
        sch["layers.0.mlp.fc1"].replace(sch["layers.0"].mod)
    with pytest.raises(schedlang.ScheduleValueError, match=r"its submodule '0' is the module at '<root>'"):
        sch["head"].replace(nn.Sequential(sch.mod))
    assert len(sch.plan) == 0
    wrapped = nn.Sequential(sch["layers.0.mlp.fc1"].mod, nn.ReLU())  # wrapping the module replaced is fine
    sch["layers.0.mlp.fc1"].replace(wrapped)
    assert sch.mod(torch.randn(2, 12)).shape == (2, 5)


def test_replace_refuses_a_class_instead_of_an_instance():
    sch = schedlang.create_schedule(MLP())
    with pytest.raises(schedlang.ScheduleTypeError, match=r"^act: replace got the class ReLU, not an instance; pass "
                                                          r"ReLU\(...\) \(an nn.Module instance\) or a function$"):
        sch["act"].replace(nn.ReLU)
    sch.trace(flatten=True)
    found = sch.find(lambda x: F.gelu(x))
    with pytest.raises(schedlang.ScheduleTypeError, match=r"^<root>: replace got the class ReLU, not an instance"):
        sch.replace(nn.ReLU, target_ops=found)  # would call ReLU(<tensor>) in the graph: a module, not a tensor
    assert [s.primitive for s in sch.plan] == ["trace"]


class _TakesTwo(nn.Module):
    def forward(self, x, gate):
        return x * gate


class _TakesMask(nn.Module):
    def forward(self, x, mask=None, *, scale=1.0):
        return x * scale


class _TakesAnything(nn.Module):
    def forward(self, *args, **kwargs):
        return args[0]


class _NeedsKeyword(nn.Module):
    def forward(self, x, *, mask):
        return x


def test_replace_refuses_a_module_whose_forward_can_never_be_called_as_the_old_one():
    sch = schedlang.create_schedule(Stack())
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"^layers.0.mlp.act: replace cannot put _TakesTwo at 'layers.0.mlp.act': its "
                             r"forward\(x, gate\) cannot be called as the GELU there is, forward\(input\): it needs "
                             r"'gate', which the old forward is never given; pass a module whose forward takes the "
                             r"same arguments$"):
        sch["layers.0.mlp.act"].replace(_TakesTwo())
    with pytest.raises(schedlang.ScheduleValueError, match=r"it needs the keyword argument 'mask', which the old "
                                                           r"forward is never given"):
        sch["layers.0.mlp.act"].replace(_NeedsKeyword())
    assert len(sch.plan) == 0
    for new in (_TakesMask(), nn.Identity(), _TakesAnything()):  # optional extras, the same input, or anything
        sch["layers.1.mlp.act"].replace(new)
    assert sch["layers.1"].mod(torch.randn(2, 12)).shape == (2, 12)

    masked = schedlang.create_schedule(_MaskedBlock())  # every call of 'inner' gives mask=...
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"^inner: replace cannot put Identity at 'inner': its forward\(input\) cannot be called "
                             r"as the _NeedsKeyword there is, forward\(x, \*, mask\): every call gives the keyword "
                             r"argument 'mask', which it cannot take"):
        masked["inner"].replace(nn.Identity())
    masked["inner"].replace(_TakesMask())
    assert masked.mod(torch.randn(2, 3)).shape == (2, 3)


class _MaskedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _NeedsKeyword()

    def forward(self, x):
        return self.inner(x, mask=None)

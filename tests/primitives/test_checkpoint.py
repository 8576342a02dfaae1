import pytest
import torch
from torch import nn

import schedlang
from tests.helpers.models import Stack


def _grads(model, x):
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    out.pow(2).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpoint_recomputes_with_equal_numerics_including_dropout():
    model = Stack(hidden=7, inner=13, layers=2)
    sch = schedlang.create_schedule(model)
    sch["layers.0"].checkpoint()
    sch["layers.1.mlp"].checkpoint()
    x = torch.randn(5, 7)
    torch.manual_seed(3)
    ref = _grads(model, x)  # training mode: dropout active, RNG preserved across recompute
    torch.manual_seed(3)
    got = _grads(sch.mod, x)
    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])
    for name, g in ref[2].items():
        torch.testing.assert_close(got[2][name], g, msg=name)


def test_checkpoint_actually_recomputes():
    counter = {"n": 0}

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            counter["n"] += 1
            return self.lin(x).tanh()

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Counting()

        def forward(self, x):
            return self.inner(x)

    sch = schedlang.create_schedule(Outer())
    sch["inner"].checkpoint()
    sch.mod(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert counter["n"] == 2  # forward, then recomputation in backward
    with torch.no_grad():
        sch.mod(torch.randn(2, 4))
    assert counter["n"] == 3


def test_checkpoint_errors():
    sch = schedlang.create_schedule(Stack())
    with pytest.raises(schedlang.ScheduleValueError, match=r"<root>: checkpointing the whole model saves nothing"):
        sch.checkpoint()
    sch["layers.0"].checkpoint()
    with pytest.raises(schedlang.ScheduleValueError, match=r"^layers\.0: already checkpointed; checkpoint each module only once$"):
        sch["layers.0"].checkpoint()
    with pytest.raises(schedlang.ScheduleValueError, match=r"layers.1: unknown checkpoint option\(s\) reentrant"):
        sch["layers.1"].checkpoint(reentrant=True)


def test_checkpoint_option_torch_would_refuse_at_the_first_backward_is_refused_at_call_time():
    sch = schedlang.create_schedule(Stack(hidden=7, inner=13))
    with pytest.raises(schedlang.ScheduleValueError, match=r"^layers.0: unknown checkpoint determinism_check 'strict': "
                                                           r"valid values are 'default', 'none'$"):
        sch["layers.0"].checkpoint(determinism_check="strict")
    assert len(sch.plan) == 0 and "forward" not in sch["layers.0"].mod.__dict__
    sch["layers.0"].checkpoint(determinism_check="none")
    sch.mod(torch.randn(3, 7, requires_grad=True)).sum().backward()

import pytest
import torch
from torch import nn

import schedlang
from schedlang.primitives.decompose import LinearWithSeparateBias
from tests.helpers.models import MLP


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_decompose_keeps_numerics(dtype, tol):
    model = MLP(7, 13).to(dtype)
    sch = schedlang.create_schedule(model)
    sch["fc1"].decompose()
    assert isinstance(sch["fc1"].mod, LinearWithSeparateBias) and isinstance(sch["fc1"].mod, nn.Linear)
    x = torch.randn(9, 7, dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    model(x).pow(2).sum().backward()
    sch.mod(x2).pow(2).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(sch["fc1"].mod.bias.grad, model.fc1.bias.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(sch["fc1"].mod.weight.grad, model.fc1.weight.grad, rtol=tol, atol=tol)


def test_decompose_errors():
    sch = schedlang.create_schedule(MLP(bias=False))
    with pytest.raises(schedlang.ScheduleValueError, match=r"fc1: Linear has no bias, so there is nothing to decompose"):
        sch["fc1"].decompose()
    with pytest.raises(schedlang.ScheduleTypeError, match=r"act: decompose applies only to nn.Linear, not GELU"):
        sch["act"].decompose()
    sch2 = schedlang.create_schedule(MLP())
    sch2["fc1"].decompose()
    with pytest.raises(schedlang.ScheduleValueError, match=r"fc1: LinearWithSeparateBias is already decomposed"):
        sch2["fc1"].decompose()

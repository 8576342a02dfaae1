"""CapturedStep: a training step replayed from a CUDA graph trains exactly as the eager step does."""

import copy

import pytest
import torch
from torch import nn

import schedlang
from schedlang.optim import FusedAdamW


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 7))


def _batches(n, device):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(13, 24, generator=g).to(device), torch.randint(0, 7, (13,), generator=g).to(device))
            for _ in range(n)]


def _loss_and_backward(model):
    def step(x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return step


def _eager_reference(model, opt, batches):
    losses = []
    for x, y in batches:
        loss = _loss_and_backward(model)(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def test_without_cuda_every_call_is_an_eager_step():
    model, twin = _model(), _model()
    opt, twin_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(twin.parameters(), lr=1e-2)
    step = schedlang.CapturedStep(_loss_and_backward(model), opt, warmup=1)
    batches = _batches(4, "cpu")
    losses = [float(step(x, y)) for x, y in batches]
    assert not step.captured and step.calls == 4
    assert losses == _eager_reference(twin, twin_opt, batches)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_errors_name_the_argument_and_what_is_valid():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(schedlang.ScheduleTypeError, match="loss_and_backward must be a callable"):
        schedlang.CapturedStep(3, opt)
    with pytest.raises(schedlang.ScheduleTypeError, match="optimizer must be a torch.optim.Optimizer, got Sequential"):
        schedlang.CapturedStep(_loss_and_backward(model), model)
    with pytest.raises(schedlang.ScheduleValueError, match=r"warmup must be an int >= 1 .*got 0"):
        schedlang.CapturedStep(_loss_and_backward(model), opt, warmup=0)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["torch-capturable", "schedlang-fused"])
def test_replayed_steps_train_exactly_like_eager_steps(optimizer):
    model = _model().cuda()
    twin = copy.deepcopy(model)

    def make(params):
        if optimizer == "schedlang-fused":
            return FusedAdamW(params, lr=1e-2)
        return torch.optim.AdamW(params, lr=1e-2, fused=True, capturable=True)

    opt, twin_opt = make(model.parameters()), make(twin.parameters())
    step = schedlang.CapturedStep(_loss_and_backward(model), opt, warmup=2)
    batches = _batches(6, "cuda")
    losses = [float(step(x, y)) for x, y in batches]
    assert step.captured
    ref = _eager_reference(twin, twin_opt, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(schedlang.ScheduleValueError, match=r"input 0 was captured as \(13, 24\) torch.float32, got \(5, 24\)"):
        step(torch.randn(5, 24, device="cuda"), batches[0][1])


@pytest.mark.gpu
def test_an_optimizer_with_a_host_step_count_is_refused_at_capture():
    model = _model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # capturable=False: step count on the host
    step = schedlang.CapturedStep(_loss_and_backward(model), opt, warmup=1)
    x, y = _batches(1, "cuda")[0]
    step(x, y)
    with pytest.raises(schedlang.ScheduleValueError, match=r"AdamW keeps its step count on the host"):
        step(x, y)

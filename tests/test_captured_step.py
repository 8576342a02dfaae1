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


@pytest.mark.gpu
def test_an_optimized_hf_model_with_compiled_layers_is_captured_whole():
    """``optimize_model``'s compiled layers meet under capture the inputs of their warm-up steps (no causal mask
    built while capturing), so the whole step is captured; the losses are those of the same schedule run eagerly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from schedlang.models import optimize_model

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, vocab_size=101, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).cuda()

    def built(compile):
        sch = schedlang.create_schedule(copy.deepcopy(model))
        optimize_model(sch, compile=compile)
        return schedlang.build(sch, optimizer="adamw", lr=1e-3)

    def loss_and_backward(net):
        def step(ids):
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                loss = net(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            return loss

        return step

    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 101, (2, 48), generator=g).cuda() for _ in range(6)]
    eager, eager_opt = built(None)
    expected = []
    for ids in batches:
        expected.append(float(loss_and_backward(eager)(ids)))
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
    net, opt = built("layers")
    step = schedlang.CapturedStep(loss_and_backward(net), opt, warmup=2)
    losses = [float(step(ids)) for ids in batches]
    assert step.captured
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-2, atol=2e-2)

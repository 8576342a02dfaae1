"""bench/bench_train.py's LayerwiseOverlappedAdamW: per-layer steps on a side stream during the backward update
the weights exactly as one FusedAdamW over the same master-weight groups (on a CUDA device, for its streams),
and nothing of it outlives the row that used it."""

import gc
import weakref

import pytest
import torch


def _train(model, opt, batches):
    losses = []
    for ids in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    torch.cuda.synchronize()
    return torch.stack(losses)


def test_nothing_outlives_the_row(bench):
    """Its hooks stay on the parameters; through them it must not keep itself, its masters and moments alive."""
    train = bench("bench_train")
    B = bench("baselines")
    model = B.full_model(B.model_config("llama", "llama-1.1b", tiny=True), torch.device("cpu"))
    opt = train.LayerwiseOverlappedAdamW(model, torch.device("cpu"))
    ids = torch.randint(0, 256, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the Linear weights are bf16 now, their masters fp32
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()  # the first step: hooks off, no stream
    opt.step()
    opt.zero_grad()
    assert opt.rest.state and all(o.state for o in opt.layer_optimizers)
    gone, params = weakref.ref(opt), weakref.ref(next(model.parameters()))
    del model, opt, loss
    gc.collect()
    assert gone() is None and params() is None


@pytest.mark.gpu
def test_layerwise_overlapped_steps_equal_one_fused_adamw(bench):
    train = bench("bench_train")
    B = bench("baselines")
    from schedlang.optim import FusedAdamW, master_weight_groups

    cfg = B.model_config("llama", "llama-1.1b", tiny=True)
    device = torch.device("cuda")
    plain, overlapped = B.full_model(cfg, device), B.full_model(cfg, device)
    plain_opt = FusedAdamW(master_weight_groups(plain), lr=B.LR, weight_decay=0.01)
    overlapped_opt = train.LayerwiseOverlappedAdamW(overlapped, device)
    layer_params = sum(len(g["params"]) for opt in overlapped_opt.layer_optimizers for g in opt.param_groups)
    assert layer_params == sum(1 for layer in B.blocks(overlapped) for _ in layer.parameters())
    generator = torch.Generator(device="cpu").manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (3, 37), generator=generator).to(device) for _ in range(4)]
    torch.testing.assert_close(_train(overlapped, overlapped_opt, batches), _train(plain, plain_opt, batches),
                               rtol=0, atol=0)
    # the first step has the hooks off (the row's gradient check); the last one stepped every layer from them
    assert overlapped_opt.layers_stepped_in_backward == len(B.blocks(overlapped))
    for (name, p), q in zip(overlapped.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)

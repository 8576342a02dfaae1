"""The fused optimizers on a CUDA device: numerics, CUDA-graph capture, no sync, no recompile."""

import pytest
import torch

from schedlang.optim import FusedAdamW, FusedSGD

pytestmark = pytest.mark.gpu

SHAPES = [(7, 13), (1000,), (1,), (3, 5, 7), (257, 1024)]


def _pairs(dtype=torch.float32):
    ours, ref = [], []
    for s in SHAPES:
        p = torch.randn(s, device="cuda")
        ours.append(p.clone().to(dtype).requires_grad_(True))
        ref.append(p.clone().requires_grad_(True))
    return ours, ref


def _set_grads(ours, ref):
    for a, b in zip(ours, ref):
        g = torch.randn_like(b)
        if a.grad is None:
            a.grad = g.to(a.dtype)
        else:
            a.grad.copy_(g)  # keep the storage: a captured graph reads it
        b.grad = g.clone()


def _compiled_kernels(fn):
    caches = getattr(fn, "device_caches", None)
    return None if caches is None else sum(len(v[0]) for v in caches.values())


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_matches_torch_on_cuda(amsgrad):
    ours, ref = _pairs()
    opt = FusedAdamW(ours, lr=torch.tensor(1e-2, device="cuda"), weight_decay=0.1, amsgrad=amsgrad)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    for step in range(12):
        if step == 6:
            opt.param_groups[0]["lr"].fill_(3e-3)
            ref_opt.param_groups[0]["lr"] = 3e-3
        _set_grads(ours, ref)
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(opt.state[a]["exp_avg_sq"], ref_opt.state[b]["exp_avg_sq"])


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_captured_step_replays_with_new_lr(kind):
    ours, ref = _pairs()
    lr = torch.tensor(1e-2, device="cuda")
    if kind == "adamw":
        opt = FusedAdamW(ours, lr=lr, weight_decay=0.05)
        ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.05)
    else:
        opt = FusedSGD(ours, lr=lr, momentum=0.9, nesterov=True)
        ref_opt = torch.optim.SGD(ref, lr=1e-2, momentum=0.9, nesterov=True)
    graph = _captured_step(opt, ref_opt, lambda: _set_grads(ours, ref))
    for value in (5e-3, 2e-3, 2e-3, 1e-3, 4e-4):
        lr.fill_(value)
        ref_opt.param_groups[0]["lr"] = value
        _set_grads(ours, ref)
        graph.replay()
        ref_opt.step()
    torch.cuda.synchronize()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if kind == "adamw":
        assert float(opt.state[ours[0]]["step"]) == 3 + 5


def test_lr_changes_neither_synchronize_nor_recompile():
    from schedlang.kernels.multi_tensor_adam import _multi_tensor_adam_kernel

    ours, ref = _pairs()
    lr = torch.tensor(1e-2, device="cuda")
    opt = FusedAdamW(ours, lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _set_grads(ours, ref)
    opt.step()
    torch.cuda.synchronize()
    compiled = _compiled_kernels(_multi_tensor_adam_kernel)
    try:
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(4):
            opt.step()
            lr.mul_(0.5)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    scheduler.step()
    opt.step()
    torch.cuda.synchronize()
    if compiled is not None:
        assert _compiled_kernels(_multi_tensor_adam_kernel) == compiled


def test_bf16_params_match_the_reference_on_cuda():
    from schedlang.kernels.multi_tensor_adam import multi_tensor_adam, reference

    params = [torch.randn(s, device="cuda").bfloat16() for s in SHAPES]
    grads = [torch.randn_like(p) for p in params]
    states = []
    for _ in range(2):
        states.append(([p.clone() for p in params], [torch.zeros_like(p, dtype=torch.float32) for p in params],
                       [torch.zeros_like(p, dtype=torch.float32) for p in params],
                       [torch.zeros((), device="cuda") for _ in params]))
    for fn, (ps, ms, vs, steps) in zip((multi_tensor_adam, reference), states):
        for _ in range(5):
            fn(ps, grads, ms, vs, [], steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
               decoupled_weight_decay=True)
    for a, b in zip(states[0][0], states[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    for a, b in zip(states[0][2], states[1][2]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_match_torch_and_replay_in_a_graph(dtype):
    """Masters follow torch.optim on fp32 weights given the upcast low-precision gradients; the
    parameters are exactly the masters rounded (the GPU's conversion); a captured step replays."""
    ours, ref = _pairs()
    lr = torch.tensor(1e-2, device="cuda")
    opt = FusedAdamW(ours, lr=lr, weight_decay=0.1, master_weights=True, compute_dtype=dtype)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    addresses = [p.data_ptr() for p in ours]

    def set_grads():
        for a, b in zip(ours, ref):
            g = torch.randn_like(b).to(dtype)
            if a.grad is None:
                a.grad = g
            else:
                a.grad.copy_(g)
            b.grad = g.float()

    graph = _captured_step(opt, ref_opt, set_grads)
    for value in (5e-3, 2e-3, 1e-3):
        lr.fill_(value)
        ref_opt.param_groups[0]["lr"] = value
        set_grads()
        graph.replay()
        ref_opt.step()
    torch.cuda.synchronize()
    masters = opt.masters()
    assert [p.data_ptr() for p in ours] == addresses
    for a, b in zip(ours, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(masters[a], b.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(a.detach(), masters[a].to(dtype))


def _captured_step(opt, ref_opt, set_grads):
    """``opt.step()`` captured in a CUDA graph after three warm-up steps of both optimizers on a side stream
    (they create the state and the launch tables)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            set_grads()
            opt.step()
            ref_opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph

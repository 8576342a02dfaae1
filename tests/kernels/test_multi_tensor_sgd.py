"""multi_tensor_sgd (Triton, interpreted on CPU) against its PyTorch reference and torch.optim,
and the bf16 rounding of the kernels against torch's."""

import pytest
import torch

from schedlang.kernels.multi_tensor_apply import ChunkTables
from schedlang.kernels.multi_tensor_sgd import multi_tensor_sgd, reference

from .common import SHAPES, SMALL, step_torch_optim



def _run(fn, params, grads_per_step, lrs, momentum, **kw):
    params = [p.clone() for p in params]
    buffers = [torch.empty(p.shape) for p in params] if momentum else []
    grads = [g.clone() for g in grads_per_step[0]]  # one storage, new values each step
    for k, (new_grads, lr) in enumerate(zip(grads_per_step, lrs)):
        for g, new in zip(grads, new_grads):
            g.copy_(new)
        fn(params, grads, buffers, [k == 0] * len(params), lr=lr, momentum=momentum, **kw)
    return params, buffers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", [
    dict(momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.1, maximize=False),
    dict(momentum=0.8, dampening=0.3, nesterov=False, weight_decay=0.0, maximize=True),
    dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.01, maximize=False),
])
def test_kernel_matches_reference(dtype, variant):
    params = [torch.randn(s).to(dtype) for s in SHAPES]
    steps = [[torch.randn(s).to(dtype) for s in SHAPES] for _ in range(4)]
    lrs = [0.1, torch.tensor(0.1), torch.tensor(0.05), 0.05]
    tables = ChunkTables()
    ours = _run(lambda *a, **k: multi_tensor_sgd(*a, **k, tables=tables, config=SMALL), params, steps, lrs, **variant)
    ref = _run(reference, params, steps, lrs, **variant)
    tol = {} if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for got, want in zip(ours[0], ref[0]):
        torch.testing.assert_close(got, want, **tol)
    for got, want in zip(ours[1], ref[1]):
        torch.testing.assert_close(got, want)
    if variant["momentum"]:
        assert tables.rebuilds == 1 and tables.tensor_table[:, 3].tolist() == [0] * len(SHAPES)


@pytest.mark.parametrize("variant", [dict(momentum=0.9, nesterov=True), dict(momentum=0.5, dampening=0.2)])
def test_reference_matches_torch_optim(variant):
    params = [torch.randn(s) for s in SHAPES]
    tparams = [p.clone().requires_grad_(True) for p in params]
    topt = torch.optim.SGD(tparams, lr=0.05, weight_decay=0.01, foreach=False, **variant)
    ours = [p.clone() for p in params]
    buffers = [torch.empty(s) for s in SHAPES]
    for k in range(4):
        grads = step_torch_optim(topt, tparams)
        reference(ours, grads, buffers, [k == 0] * len(SHAPES), lr=0.05, weight_decay=0.01,
                  dampening=variant.get("dampening", 0.0), **{k_: v for k_, v in variant.items() if k_ != "dampening"})
    for got, want in zip(ours, tparams):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # 3e38 + 3e38 overflows on purpose
def test_bf16_store_rounds_to_nearest_even():
    """p - g in fp32 then bf16: ties, carries, infinities and NaN round as torch rounds them."""
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    p = torch.tensor([1.0, 1.0, 1.0, 1.0, 3.0e38, float("inf"), float("nan"), -1.0] + [0.0] * 8)
    g = torch.tensor([-ulp / 2, -3 * ulp / 2, -ulp / 4, -(1 - ulp / 2) * 1.0, -3.0e38, 1.0, 1.0, ulp / 2] + [0.0] * 8)
    noise = torch.randn(1000) * 3
    p = torch.cat([p, noise]).bfloat16()
    g_f32 = torch.cat([g, torch.randn(1000)])
    # the grads the kernel reads are bf16 too: keep the cases whose gradient bf16 holds exactly
    g_b = g_f32.bfloat16()
    ours = [p.clone()]
    multi_tensor_sgd(ours, [g_b], [], [False], lr=1.0, momentum=0.0, dampening=0.0, weight_decay=0.0)
    want = (p.float() - g_b.float()).bfloat16()
    assert torch.equal(ours[0].float().nan_to_num(7.0), want.float().nan_to_num(7.0))
    assert torch.isnan(ours[0][6]) and ours[0][5] == float("inf")
    assert ours[0][0] == 1.0 and ours[0][1] == 1.0 + 2 * ulp  # ties to even, both ways

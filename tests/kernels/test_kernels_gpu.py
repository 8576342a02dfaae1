"""The multi-tensor kernels compiled for a CUDA device, with their default launch shape, against the
PyTorch references (the other kernel tests run interpreted on CPU, or on the GPU with small launch shapes)."""

import pytest
import torch

from schedlang.kernels.multi_tensor_adam import multi_tensor_adam
from schedlang.kernels.multi_tensor_adam import reference as adam_reference
from schedlang.kernels.multi_tensor_apply import ChunkTables
from schedlang.kernels.multi_tensor_sgd import multi_tensor_sgd
from schedlang.kernels.multi_tensor_sgd import reference as sgd_reference

pytestmark = pytest.mark.gpu

# several chunks of the default launch shape, a masked tail, and tiny tensors
SHAPES = [(7, 13), (1000,), (1,), (257, 1023), (3, 5, 7)]
TOLERANCES = {torch.float32: {}, torch.bfloat16: dict(rtol=1e-2, atol=1e-2), torch.float16: dict(rtol=1e-3, atol=1e-3)}


def _tensors(dtype):
    return [torch.randn(s, device="cuda").to(dtype) for s in SHAPES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_adam_kernel_on_cuda_matches_reference(dtype):
    params = _tensors(dtype)
    states = []
    for _ in range(2):
        fp32 = lambda: [torch.zeros(s, device="cuda") for s in SHAPES]  # noqa: E731
        states.append(([p.clone() for p in params], fp32(), fp32(), fp32(),
                       [torch.zeros((), device="cuda") for _ in SHAPES]))
    tables = ChunkTables()
    for step in range(3):
        grads = _tensors(dtype)
        lr = torch.tensor(1e-2, device="cuda") if step % 2 else 3e-3
        kw = dict(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=True,
                  decoupled_weight_decay=True)
        multi_tensor_adam(states[0][0], [g.clone() for g in grads], *states[0][1:], **kw, tables=tables)
        adam_reference(states[1][0], [g.clone() for g in grads], *states[1][1:], **kw)
    for got, want in zip(states[0][0], states[1][0]):
        assert got.is_cuda and got.dtype == dtype
        torch.testing.assert_close(got, want, **TOLERANCES[dtype])
    for got_list, want_list in zip(states[0][1:4], states[1][1:4]):
        for got, want in zip(got_list, want_list):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgd_kernel_on_cuda_matches_reference(dtype):
    params = _tensors(dtype)
    ours, ref = [p.clone() for p in params], [p.clone() for p in params]
    buffers = [[torch.empty(s, device="cuda") for s in SHAPES] for _ in range(2)]
    tables = ChunkTables()
    for step in range(3):
        grads = _tensors(dtype)
        kw = dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True)
        multi_tensor_sgd(ours, [g.clone() for g in grads], buffers[0], [step == 0] * len(SHAPES), **kw, tables=tables)
        sgd_reference(ref, [g.clone() for g in grads], buffers[1], [step == 0] * len(SHAPES), **kw)
    for got, want in zip(ours, ref):
        assert got.is_cuda
        torch.testing.assert_close(got, want, **TOLERANCES[dtype])
    for got, want in zip(*buffers):
        torch.testing.assert_close(got, want)

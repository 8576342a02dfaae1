"""multi_tensor_adam (Triton, interpreted on CPU) against its PyTorch reference, and the
reference against torch.optim."""

import pytest
import torch

from schedlang.kernels.multi_tensor_adam import AdamLauncher, multi_tensor_adam, reference
from schedlang.kernels.multi_tensor_apply import ChunkTables

from .common import SHAPES, SMALL, step_torch_optim


def _state(params, amsgrad):
    zeros = lambda: [torch.zeros(p.shape, dtype=torch.float32) for p in params]  # noqa: E731
    return ([p.clone() for p in params], zeros(), zeros(), zeros() if amsgrad else [],
            [torch.zeros(()) for _ in params])


def _run(fn, state, grads_per_step, lrs, **kw):
    p, m, v, vm, s = state
    grads = [g.clone() for g in grads_per_step[0]]  # one storage, new values each step
    for new_grads, lr in zip(grads_per_step, lrs):
        for g, new in zip(grads, new_grads):
            g.copy_(new)
        fn(p, grads, m, v, vm, s, lr=lr, **kw)
    return state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", [
    dict(amsgrad=False, maximize=False, decoupled_weight_decay=True, weight_decay=0.1),
    dict(amsgrad=True, maximize=True, decoupled_weight_decay=False, weight_decay=0.05),
    dict(amsgrad=False, maximize=False, decoupled_weight_decay=False, weight_decay=0.0),
])
def test_kernel_matches_reference(dtype, variant):
    params = [torch.randn(s).to(dtype) for s in SHAPES]
    steps = [[torch.randn(s).to(dtype) for s in SHAPES] for _ in range(4)]
    lrs = [1e-2, torch.tensor(1e-2), torch.tensor(3e-3), 3e-3]  # float and device-tensor lr
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, **variant)
    tables = ChunkTables()
    ours = _run(lambda *a, **k: multi_tensor_adam(*a, **k, tables=tables, config=SMALL),
                _state(params, variant["amsgrad"]), steps, lrs, **kw)
    ref = _run(reference, _state(params, variant["amsgrad"]), steps, lrs, **kw)
    tol = {} if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for got, want in zip(ours[0], ref[0]):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, **tol)
    for lists in zip(ours[1:4], ref[1:4]):
        for got, want in zip(*lists):
            torch.testing.assert_close(got, want)
    assert [float(s) for s in ours[4]] == [4.0] * len(SHAPES)
    assert tables.rebuilds == 1  # same tensors every step: the tables were built once


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("decoupled", [False, True])
def test_reference_matches_torch_optim(amsgrad, decoupled):
    """The reference is the bridge for bf16: check it is torch.optim exactly in fp32."""
    params = [torch.randn(s) for s in SHAPES]
    tparams = [p.clone().requires_grad_(True) for p in params]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    topt = cls(tparams, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=amsgrad, foreach=False)
    state = _state(params, amsgrad)
    for _ in range(5):
        grads = step_torch_optim(topt, tparams)
        reference(state[0], grads, *state[1:], lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1,
                  amsgrad=amsgrad, decoupled_weight_decay=decoupled)
    for got, want in zip(state[0], tparams):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)


def test_bias_correction_is_accurate_at_the_first_steps():
    """1 - beta2^t is ~1e-3 at t = 1: computed as -expm1(t log beta) it keeps fp32 accuracy."""
    p = [torch.randn(300)]
    g = [torch.randn(300)]
    for beta2 in (0.999, 0.99999, 0.0):
        ours, ref = _state(p, False), _state(p, False)
        kw = dict(lr=1.0, beta1=0.9, beta2=beta2, eps=1e-30, weight_decay=0.0)
        multi_tensor_adam(ours[0], g, *ours[1:], **kw)
        reference(ref[0], g, *ref[1:], **kw)
        torch.testing.assert_close(ours[0][0], ref[0][0], rtol=1e-6, atol=1e-6)


def test_non_contiguous_and_unaligned_tensors():
    base = torch.randn(2000)
    unaligned = base[1:1001]  # 4 bytes past an aligned address: no 16-byte vector hint
    strided = torch.randn(13, 7).t()  # (7, 13), not contiguous: updated by the reference
    params = [unaligned, strided, torch.randn(37)]
    # the strided parameter's gradient is contiguous, so its memory order differs from the parameter's:
    # an update that walked both as flat ranges would pair elements with other elements' gradients
    grads = [torch.randn(1000), torch.randn(7, 13), torch.randn(37)]
    ours = ([t.clone() if t.is_contiguous() else t.clone().t().contiguous().t() for t in params],
            [torch.zeros_like(t) for t in params], [torch.zeros_like(t) for t in params], [],
            [torch.zeros(()) for _ in params])
    ours[0][0] = torch.zeros(2000)[1:1001].copy_(unaligned)
    assert not ours[0][1].is_contiguous() and ours[0][0].data_ptr() % 16
    ref = _state(params, False)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True)
    tables = ChunkTables()
    launcher = AdamLauncher(ours[0], grads, *ours[1:], tables=tables, config=SMALL)
    assert launcher.strided == [1] and not tables.aligned
    for _ in range(3):
        launcher(grads, **kw)
        reference(ref[0], grads, *ref[1:], **kw)
    for lists in zip(ours[:3], ref[:3]):  # parameters, exp_avg, exp_avg_sq
        for got, want in zip(*lists):
            torch.testing.assert_close(got, want)
    assert [float(s) for s in ours[4]] == [3.0, 3.0, 3.0]


def test_chunk_tables_rebuild_only_when_an_address_changes():
    params = [torch.randn(s) for s in SHAPES]
    state = _state(params, False)
    tables = ChunkTables()
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, tables=tables, config=SMALL)
    grads = [torch.randn(s) for s in SHAPES]
    multi_tensor_adam(state[0], grads, *state[1:], **kw)
    multi_tensor_adam(state[0], grads, *state[1:], **kw)
    assert tables.rebuilds == 1
    chunk_map = tables.chunk_map
    moved = [g.clone() for g in grads]  # same values, new storage
    multi_tensor_adam(state[0], moved, *state[1:], **kw)
    assert tables.rebuilds == 2
    assert tables.chunk_map is chunk_map  # same sizes: only the tensor table was rebuilt
    assert tables.tensor_table[:, 1].tolist() == [g.data_ptr() for g in moved]
    chunk_map = tables.chunk_map.tolist()
    # 91 elements: 1 chunk; 1000: 4 chunks of 256; 1: 1; 105: 1
    assert chunk_map == [[0, 0], [1, 0], [1, 1], [1, 2], [1, 3], [2, 0], [3, 0]]
    assert tables.tensor_table[:, -1].tolist() == [91, 1000, 1, 105]


def _master_state(params, dtype, amsgrad):
    """Parameters rounded to ``dtype`` plus their fp32 masters, and fresh state."""
    p, m, v, vm, s = _state(params, amsgrad)
    return [t.to(dtype) for t in p], m, v, vm, s, [t.clone() for t in params]


def _run_master(fn, state, grads_per_step, lrs, **kw):
    p, m, v, vm, s, masters = state
    grads = [g.clone() for g in grads_per_step[0]]
    for new_grads, lr in zip(grads_per_step, lrs):
        for g, new in zip(grads, new_grads):
            g.copy_(new)
        fn(p, grads, m, v, vm, s, lr=lr, masters=masters, **kw)
    return state


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", [
    dict(amsgrad=False, maximize=False, decoupled_weight_decay=True, weight_decay=0.1),
    dict(amsgrad=True, maximize=True, decoupled_weight_decay=False, weight_decay=0.05),
])
def test_master_weights_kernel_matches_reference(dtype, variant):
    """With masters: fp32 masters and state as the reference's; the parameter is exactly the
    master rounded to nearest even (the kernel's integer rounding against ``Tensor.to``)."""
    params = [torch.randn(s) for s in SHAPES]
    steps = [[torch.randn(s).to(dtype) for s in SHAPES] for _ in range(3)]
    lrs = [1e-2, torch.tensor(1e-2), 3e-3]
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, **variant)
    tables = ChunkTables()
    ours = _run_master(lambda *a, **k: multi_tensor_adam(*a, **k, tables=tables, config=SMALL),
                       _master_state(params, dtype, variant["amsgrad"]), steps, lrs, **kw)
    ref = _run_master(reference, _master_state(params, dtype, variant["amsgrad"]), steps, lrs, **kw)
    for lists in zip(ours[1:4] + ours[5:], ref[1:4] + ref[5:]):  # m, v, vmax, masters
        for got, want in zip(*lists):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want)
    for p, master, before in zip(ours[0], ours[5], params):
        assert p.dtype == dtype
        assert torch.equal(p, master.to(dtype))
        assert not torch.equal(master, before)  # the masters did move
    for p, master in zip(ref[0], ref[5]):
        assert torch.equal(p, master.to(dtype))
    assert tables.rebuilds == 1 and tables.tensor_table[:, 6].tolist() == [w.data_ptr() for w in ours[5]]


def test_master_weights_round_ties_to_even():
    """Values exactly halfway between two bf16 numbers: the kernel must round to the even one
    (truncation, or rounding half up, would differ on one of the two)."""
    # 1 + 2^-8 lies halfway between bf16 1 and 1 + 2^-7; 1 + 3 * 2^-8 halfway between 1 + 2^-7 and 1 + 2^-6
    halfway = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)] * 30)
    masters = [halfway.clone()]
    params = [torch.zeros(90, dtype=torch.bfloat16)]
    zero = [torch.zeros(90, dtype=torch.bfloat16)]
    # lr = 0: the masters keep their values, and the parameter is their rounding
    multi_tensor_adam(params, zero, [torch.zeros(90)], [torch.zeros(90)], [], [torch.zeros(())], lr=0.0,
                      beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, masters=masters, config=SMALL)
    assert torch.equal(masters[0], halfway)
    assert params[0][:3].tolist() == [1.0, 1 + 2**-6, -1.0]
    assert torch.equal(params[0], halfway.to(torch.bfloat16))


@pytest.mark.parametrize("amsgrad", [False, True])
def test_reference_with_masters_is_the_fp32_update(amsgrad):
    """The masters follow exactly the fp32 update of the same values with the upcast gradients."""
    params = [torch.randn(s) for s in SHAPES]
    plain = _state(params, amsgrad)
    with_masters = _master_state(params, torch.bfloat16, amsgrad)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=amsgrad,
              decoupled_weight_decay=True)
    for _ in range(4):
        grads = [torch.randn(s).to(torch.bfloat16) for s in SHAPES]
        reference(plain[0], [g.float() for g in grads], *plain[1:], **kw)
        reference(with_masters[0], grads, *with_masters[1:5], masters=with_masters[5], **kw)
    for got, want in zip(with_masters[5], plain[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_master_weights_of_a_strided_parameter_go_through_the_reference():
    """A transposed parameter (and its master) is updated by the reference, master included."""
    fp32 = [torch.randn(13, 7).t(), torch.randn(1000)]
    masters = [t.clone(memory_format=torch.preserve_format) for t in fp32]
    params = [t.to(torch.bfloat16) for t in masters]
    assert not params[0].is_contiguous() and not masters[0].is_contiguous()
    grads = [torch.randn(7, 13).to(torch.bfloat16), torch.randn(1000).to(torch.bfloat16)]
    state = ([torch.zeros(7, 13), torch.zeros(1000)], [torch.zeros(7, 13), torch.zeros(1000)], [],
             [torch.zeros(()), torch.zeros(())])
    ref = _master_state([t.contiguous() for t in fp32], torch.bfloat16, False)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True)
    launcher = AdamLauncher(params, grads, *state, masters=masters, config=SMALL)
    assert launcher.strided == [0]
    for _ in range(3):
        launcher(grads, **kw)
        reference(ref[0], grads, *ref[1:5], masters=ref[5], **kw)
    for got, want in zip(masters, ref[5]):
        torch.testing.assert_close(got, want)
    for p, master in zip(params, masters):
        assert torch.equal(p, master.to(torch.bfloat16))

"""Shared checks for the fusion compilers: run a fused subgraph and a PyTorch reference on
the same inputs and weights, compare outputs and the gradients of every input and
parameter.

The reference runs in float64 on the same (upcast) inputs and weights: the kernels compute
in float32 and round only where the program casts, so comparing against PyTorch's own
rounding of every intermediate (bf16) or its own summation order (float32) would measure
PyTorch's error as much as ours. Output dtypes and shapes are checked against eager
PyTorch.
"""

from __future__ import annotations

import copy

import torch
import torch.fx

from schedlang.lowering import lower_subgraph

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def trace(fn) -> torch.fx.GraphModule:
    return fn if isinstance(fn, torch.fx.GraphModule) else torch.fx.symbolic_trace(fn)


def _tolerance(dtypes):
    lowest = max(dtypes, key=lambda d: TOLERANCES[d]["rtol"])
    return TOLERANCES[lowest]


def check_fused(fn, inputs, compiler="triton", name="Fused", grad=True, train=False, example_inputs=False,
                tol=None):
    """Lower ``fn`` (a function, module or GraphModule), run it on ``inputs`` and compare
    with PyTorch, forward and backward. Returns the fused module."""
    gm = trace(fn)
    gm.train(train)
    reference = copy.deepcopy(gm).to(DEVICE)
    inputs = [t.to(DEVICE) for t in inputs]
    fused = lower_subgraph(gm, compiler, name, example_inputs=inputs if example_inputs else None).to(DEVICE)
    fused.train(train)

    def leaf(t, dtype=None):
        t = t.detach().to(dtype or t.dtype)
        return t.requires_grad_(grad and t.is_floating_point())

    ours_in = [leaf(t) for t in inputs]
    low = [p.dtype for p in reference.parameters()]
    reference = reference.double()
    ref_in = [leaf(t, torch.float64 if t.is_floating_point() else None) for t in inputs]

    ours = fused(*ours_in)
    with torch.no_grad():
        eager = gm.to(DEVICE)(*[t.detach() for t in inputs])  # for the output dtypes PyTorch picks
    ref = reference(*ref_in)
    ours_t = ours if isinstance(ours, tuple) else (ours,)
    ref_t = ref if isinstance(ref, tuple) else (ref,)
    eager_t = eager if isinstance(eager, tuple) else (eager,)
    assert len(ours_t) == len(ref_t)
    dtypes = {t.dtype for t in inputs if t.is_floating_point()} | {t.dtype for t in eager_t} | set(low)
    tolerance = tol or _tolerance(dtypes or {torch.float32})
    for o, r, e in zip(ours_t, ref_t, eager_t):
        assert o.shape == e.shape and o.dtype == e.dtype, (o.shape, e.shape, o.dtype, e.dtype)
        assert o.device.type == DEVICE.type
        torch.testing.assert_close(o.to(r.dtype), r, **tolerance)
    if not grad:
        return fused
    grad_outs = [torch.randn_like(e) if e.is_floating_point() else None for e in eager_t]
    pairs = [(o, r, g) for o, r, g in zip(ours_t, ref_t, grad_outs) if g is not None and o.requires_grad]
    ours_params = dict(fused.named_parameters())
    ref_params = dict(reference.named_parameters())
    assert ours_params.keys() == ref_params.keys()
    ours_wrt = [t for t in ours_in if t.requires_grad] + list(ours_params.values())
    ref_wrt = [t for t in ref_in if t.requires_grad] + [ref_params[k] for k in ours_params]
    got = torch.autograd.grad([p[0] for p in pairs], ours_wrt, [p[2] for p in pairs], allow_unused=True)
    want = torch.autograd.grad([p[1] for p in pairs], ref_wrt, [p[2].to(p[1].dtype) for p in pairs],
                               allow_unused=True)
    for k, (a, b, t) in enumerate(zip(got, want, ours_wrt)):
        if b is None:
            assert a is None or not a.any(), f"gradient {k}: expected none"
            continue
        assert a is not None, f"gradient {k} missing"
        assert a.shape == t.shape and a.dtype == t.dtype, (k, a.shape, t.shape, a.dtype, t.dtype)
        scale = max(1.0, b.abs().max().item())  # sums over many rows grow with the row count
        torch.testing.assert_close(a.to(b.dtype) / scale, b / scale, **tolerance)
    return fused

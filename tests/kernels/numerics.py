"""Tolerances shared by the training-step kernel tests.

The kernels compute in fp32 and round once; the references round after every eager op, so in
bf16 / fp16 the two differ by a few units in the last place of the *reference*. Errors are
measured against the largest magnitude of the expected tensor (a sum over 1000 rows in bf16 has
an ulp of its size, not of its smallest element), with no floor: the gradients of a mean over
many tokens are far below 1, and an absolute tolerance of 2e-2 would let them be wrong by half."""

import torch

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def assert_close_scaled(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """``max |got - want| <= tol(dtype) * max |want|``, both compared in fp32 (exactly equal where ``want``
    is all zeros)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.detach().float(), want.detach().float()
    scale = want.abs().max().item() if want.numel() else 1.0
    err = (got - want).abs().max().item() if want.numel() else 0.0
    assert err <= TOLERANCE[dtype] * scale, f"{what}: max error {err:.3g} > {TOLERANCE[dtype]:.1g} * {scale:.3g}"

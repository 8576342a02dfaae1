"""Comparing one tensor of the scheduled model with its counterpart in the original model.

A schedule that reorders a reduction (tensor parallelism sums partial products in another
order, a fused kernel accumulates differently) changes the rounding, so the two models never
agree bit for bit. How far they may drift follows the dtype (its machine epsilon) and the
length ``K`` of the reductions behind the tensor. CPUs and GPUs accumulate half-precision sums
in fp32, so the error of a long sum is dominated by the final rounding to the output dtype
and grows only slowly with ``K``: the norm bound is ``3 eps`` up to ``K = 256`` and grows with
``log2(K) / 8`` beyond.

A tensor passes when every element is within the elementwise bound
``atol * max|expected| + rtol * |expected|``, or, in half precision only, when

* the error over the whole tensor is small: ``||actual - expected|| <= norm_rtol * ||expected||``
  (``norm_rtol`` grows with ``log K``), and
* the elements outside the elementwise bound are few (at most 1% of them) and none is
  more than :data:`OUTLIER_FACTOR` times outside it.

A single element of a LayerNorm gradient that cancels down to almost nothing can lose
all its significant digits in fp16 even when the schedule is right; a wrong schedule moves
the whole tensor, which the norm bound catches.

A model with float8 Linears (``float8`` primitive) rounds every GEMM operand to 3 mantissa bits
(e4m3) and every output gradient to 2 (e5m2): no element is expected to match, so tensors are
compared by the norm bound alone, :data:`FLOAT8_TOLERANCE` (a relative error of 0.3 of the whole
tensor: first-step gradients of a float8 LLaMA measure 0.15-0.2 against bf16 on an H100; a lost
all-reduce or a wrong shard moves a tensor by 0.7 or more).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional

import torch

__all__ = ["Tolerance", "DEFAULT_TOLERANCES", "tolerance_for", "compare_tensors", "nonfinite_summary",
           "reduction_size_of"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How close a tensor of one dtype must be.

    ``rtol`` / ``atol``: elementwise (``atol`` is scaled by the largest ``|expected|``);
    ``norm_rtol``: the relative error of the whole tensor allowed for a reduction of up to 256
    terms (scaled by ``log2(K) / 8`` for longer ones); ``outlier_fraction``: the share of elements that
    may fall outside the elementwise bound when the norm bound holds (0: none).
    """

    rtol: float
    atol: float
    norm_rtol: float = 0.0
    outlier_fraction: float = 0.0
    #: compare by the norm bound alone (float8): no element is expected to be within rtol / atol
    norm_only: bool = False


_EPS = {dtype: torch.finfo(dtype).eps for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}

#: per-dtype defaults; half precision allows a few outliers when the whole tensor is close
DEFAULT_TOLERANCES: Dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(1e-7, 1e-7),
    torch.float32: Tolerance(1e-4, 1e-5),
    torch.float16: Tolerance(1e-2, 1e-3, norm_rtol=3 * _EPS[torch.float16], outlier_fraction=0.01),
    torch.bfloat16: Tolerance(2e-2, 2e-2, norm_rtol=3 * _EPS[torch.bfloat16], outlier_fraction=0.01),
}

#: an outlier may be at most this many times outside the elementwise bound
OUTLIER_FACTOR = 8.0

#: a model with float8 Linears, whatever the dtype of the tensor compared
FLOAT8_TOLERANCE = Tolerance(0.0, 0.0, norm_rtol=0.3, norm_only=True)


def tolerance_for(dtype: torch.dtype, rtol: Optional[float] = None, atol: Optional[float] = None,
                  reduction_size: int = 1, float8: bool = False) -> Tolerance:
    """The tolerance for ``dtype``; explicit ``rtol`` / ``atol`` replace the elementwise bound and turn
    the outlier allowance off (the caller asked for exactly that bound). ``float8``: the model has
    float8 Linears (:data:`FLOAT8_TOLERANCE`)."""
    base = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])
    if rtol is not None or atol is not None:
        return Tolerance(base.rtol if rtol is None else rtol, base.atol if atol is None else atol)
    if float8:
        return FLOAT8_TOLERANCE
    scale = max(1.0, math.log2(max(reduction_size, 1)) / 8.0)
    return dataclasses.replace(base, norm_rtol=base.norm_rtol * scale)


def nonfinite_summary(t: torch.Tensor) -> Optional[str]:
    """``"3 NaN, 1 inf of 40 elements"`` if ``t`` holds non-finite values, else None."""
    if not t.is_floating_point() or t.numel() == 0:
        return None
    x = t.detach()
    nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
    if not nan and not inf:
        return None
    parts = ([f"{nan} NaN"] if nan else []) + ([f"{inf} inf"] if inf else [])
    return f"{', '.join(parts)} of {x.numel()} elements"


def _plain(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "to_local", None)  # a DTensor: its local shard
    return (local() if callable(local) else t).detach()


def compare_tensors(what: str, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> Optional[str]:
    """None if ``actual`` is close enough to ``expected``, else a message that says by how much."""
    actual, expected = _plain(actual), _plain(expected)
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)} but the original gives {tuple(expected.shape)}"
    if not expected.is_floating_point():
        if not torch.equal(actual.cpu(), expected.cpu()):
            diff = int((actual.cpu() != expected.cpu()).sum())
            return f"{what}: {diff} of {expected.numel()} values differ (integer tensor)"
        return None
    if expected.numel() == 0:
        return None
    act, exp = actual.double().cpu(), expected.double().cpu()
    both_nan = torch.isnan(act) & torch.isnan(exp)
    same_inf = torch.isinf(act) & (act == exp)
    matched = both_nan | same_inf
    if bool((torch.isnan(act) & ~matched).any()):
        return f"{what}: contains NaN where the original has none ({nonfinite_summary(actual)})"
    finite = torch.isfinite(exp)
    scale = max(1.0, float(exp[finite].abs().max())) if bool(finite.any()) else 1.0
    diff = torch.where(matched, torch.zeros_like(act), (act - exp).abs())
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, math.inf))
    bound = tol.atol * scale + tol.rtol * torch.where(finite, exp.abs(), torch.zeros_like(exp))
    bad = diff > bound
    n_bad = int(bad.sum())
    if n_bad == 0:
        return None
    err = torch.where(matched, torch.zeros_like(act), act - exp)
    rel = math.inf
    if bool(finite.any()):
        rel = float(err[finite & ~matched].norm()) / max(float(exp[finite].norm()), 1e-30)
    if tol.norm_only and rel <= tol.norm_rtol:
        return None
    if tol.outlier_fraction > 0:
        allowed = max(1, int(tol.outlier_fraction * exp.numel()))
        worst_ratio = float((diff[bad] / bound[bad].clamp_min(1e-300)).max())
        if n_bad <= allowed and rel <= tol.norm_rtol and worst_ratio <= OUTLIER_FACTOR:
            return None
    worst = int(torch.argmax(torch.where(bad, diff, torch.zeros_like(diff))))
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape)) if diff.dim() else ()
    norm_part = f", relative error of the whole tensor {rel:.3g}"
    if tol.norm_only:
        norm_part += f" (allowed {tol.norm_rtol:.3g} with float8 Linears)"
    elif tol.norm_rtol:
        norm_part += f" (allowed {tol.norm_rtol:.3g}, with up to {tol.outlier_fraction:.0%} outlier elements)"
    return (f"{what}: max abs diff {float(diff.max()):.3e} at index {index} (got {float(act.flatten()[worst]):.6g}, "
            f"expected {float(exp.flatten()[worst]):.6g}); {n_bad} of {bad.numel()} elements outside "
            f"rtol={tol.rtol:g}, atol={tol.atol:g}x{scale:.3g}{norm_part}")


def reduction_size_of(model: torch.nn.Module, inputs) -> int:
    """An estimate of the longest reduction behind the model's outputs and gradients: the widest
    input dimension of a weight matrix (forward matmuls) or the number of tokens in the example
    inputs (a weight gradient sums over them), whichever is larger."""
    widest = 1
    for p in model.parameters():
        if p.dim() >= 2:
            widest = max(widest, *p.shape[1:])
    tokens = 1
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            rows = x.numel() // x.shape[-1] if x.is_floating_point() and x.shape[-1] else x.numel()
            tokens = max(tokens, rows)
    return max(widest, tokens)


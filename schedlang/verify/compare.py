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
* the elements outside the elementwise bound are no more than rounding noise puts there by chance
  (:func:`outlier_allowance`), and none is more than :data:`OUTLIER_FACTOR` times outside it.

A single element of a LayerNorm gradient that cancels down to almost nothing can lose
all its significant digits in fp16 even when the schedule is right; a wrong schedule moves
the whole tensor, which the norm bound catches.

How many outliers chance allows: the rounding error of an element is modelled as Gaussian noise
whose size is the typical error of the whole tensor, half the norm bound (``sigma = norm_rtol / 2``
times the root mean square of the expected tensor; fp16 LayerNorm gradients of a tensor-parallel
GPT-2 measure 0.4 of the bound). An element with bound ``b`` then falls outside with probability
``erfc(b / (sigma sqrt 2))``; the expected count ``lambda`` is their sum, and the count allowed is
the smallest ``m`` that a Poisson variable of mean ``lambda`` (whose tail bounds that of any sum of
independent rare events of that mean) exceeds with probability at most
:data:`OUTLIER_FALSE_ALARM_RATE`. So the allowance follows the dtype, the reduction length (through
``norm_rtol``) and the tensor's size: for a Gaussian tensor in fp16 with ``K = 1024`` it is 7 of 256
elements, 10 of 1024 and 72 of 65536, where a flat 1% allowed 2, 10 and 655. In bf16 the
elementwise bound is some six sigma and no element is expected outside it; one element is always
allowed.

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
           "reduction_size_of", "outlier_allowance"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How close a tensor of one dtype must be.

    ``rtol`` / ``atol``: elementwise (``atol`` is scaled by the largest ``|expected|``);
    ``norm_rtol``: the relative error of the whole tensor allowed for a reduction of up to 256
    terms (scaled by ``log2(K) / 8`` for longer ones); ``allow_outliers``: when the norm bound holds,
    the elements that rounding noise puts outside the elementwise bound by chance
    (:func:`outlier_allowance`) do not fail the tensor.
    """

    rtol: float
    atol: float
    norm_rtol: float = 0.0
    allow_outliers: bool = False
    #: compare by the norm bound alone (float8): no element is expected to be within rtol / atol
    norm_only: bool = False


_EPS = {dtype: torch.finfo(dtype).eps for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}

#: per-dtype defaults; half precision allows a few outliers when the whole tensor is close
DEFAULT_TOLERANCES: Dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(1e-7, 1e-7),
    torch.float32: Tolerance(1e-4, 1e-5),
    torch.float16: Tolerance(1e-2, 1e-3, norm_rtol=3 * _EPS[torch.float16], allow_outliers=True),
    torch.bfloat16: Tolerance(2e-2, 2e-2, norm_rtol=3 * _EPS[torch.bfloat16], allow_outliers=True),
}

#: an outlier may be at most this many times outside the elementwise bound
OUTLIER_FACTOR = 8.0

#: the chance, per tensor, that a correct schedule's rounding noise puts more elements outside the
#: elementwise bound than :func:`outlier_allowance` allows (one Verify compares some hundreds of tensors)
OUTLIER_FALSE_ALARM_RATE = 1e-6

#: the norm bound is this many times the typical relative rounding error of a whole tensor
_NORM_BOUND_SIGMAS = 2.0

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
    allowed = None
    if tol.allow_outliers and rel <= tol.norm_rtol:
        worst_ratio = float((diff[bad] / bound[bad].clamp_min(1e-300)).max())
        allowed = outlier_allowance(exp.where(finite, torch.zeros_like(exp)), bound, tol.norm_rtol)
        if n_bad <= allowed and worst_ratio <= OUTLIER_FACTOR:
            return None
    worst = int(torch.argmax(torch.where(bad, diff, torch.zeros_like(diff))))
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape)) if diff.dim() else ()
    norm_part = f", relative error of the whole tensor {rel:.3g}"
    if tol.norm_only:
        norm_part += f" (allowed {tol.norm_rtol:.3g} with float8 Linears)"
    elif tol.allow_outliers:
        norm_part += f" (allowed {tol.norm_rtol:.3g}"
        if allowed is not None:
            norm_part += (f"; when it holds, rounding noise explains up to {allowed} elements outside, each at most "
                          f"{OUTLIER_FACTOR:g}x")
        norm_part += ")"
    return (f"{what}: max abs diff {float(diff.max()):.3e} at index {index} (got {float(act.flatten()[worst]):.6g}, "
            f"expected {float(exp.flatten()[worst]):.6g}); {n_bad} of {bad.numel()} elements outside "
            f"rtol={tol.rtol:g}, atol={tol.atol:g}x{scale:.3g}{norm_part}")


def outlier_allowance(expected: torch.Tensor, bound: torch.Tensor, norm_rtol: float) -> int:
    """How many elements of ``expected`` rounding noise may put outside their elementwise ``bound`` by chance,
    when the whole tensor's relative error is within ``norm_rtol`` (see the module's docstring).

    The noise level is that of the elements that carry any value: structural zeros (the gradient rows of
    tokens not in the batch) have no rounding, and counting them would shrink the noise of the others."""
    carrying = expected != 0
    if not bool(carrying.any()) or norm_rtol <= 0:
        return 0
    rms = float(expected[carrying].pow(2).mean().sqrt())
    sigma = norm_rtol / _NORM_BOUND_SIGMAS * rms
    expected_count = float(torch.special.erfc(bound[carrying] / (sigma * math.sqrt(2.0))).sum())
    # one element is always allowed: the Gaussian model is thin in the far tail, and one element within
    # OUTLIER_FACTOR of its bound in a tensor within the norm bound cannot hide a wrong schedule
    return max(1, _poisson_upper_quantile(expected_count, OUTLIER_FALSE_ALARM_RATE))


def _poisson_upper_quantile(mean: float, tail: float) -> int:
    """The smallest ``m`` with ``P(X > m) <= tail`` for ``X`` Poisson of ``mean``. A sum of independent
    rare events of that mean exceeds ``m`` no more often (Hoeffding, 1956)."""
    if mean <= 0:
        return 0
    if mean > 500:  # Bernstein's bound, P(X >= mean + t) <= exp(-t^2 / (2 (mean + t / 3))): no long sum
        log_tail = math.log(1.0 / tail)
        return int(math.ceil(mean + log_tail / 3 + math.sqrt(log_tail ** 2 / 9 + 2 * log_tail * mean)))
    m, term = 0, math.exp(-mean)
    cdf = term
    while 1.0 - cdf > tail:
        m += 1
        term *= mean / m
        cdf += term
    return m


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


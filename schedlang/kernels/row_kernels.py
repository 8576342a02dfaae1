"""Pieces shared by the training-step kernels (RMSNorm, rotary, SwiGLU, cross entropy).

* :func:`use_triton_for` decides, per call, between a Triton kernel and its PyTorch reference:
  CUDA tensors always take the kernel; CPU tensors only under the numpy interpreter
  (``TRITON_INTERPRET=1``, how CI tests the kernels), so CPU users get the reference.
* :func:`cast_rounded` converts fp32 values to the storage dtype rounding to nearest even. The
  GPU does this in hardware; the numpy interpreter truncates fp32 -> bf16, so bf16 is rounded with
  integer arithmetic that gives the GPU's result on both (a handful of integer ops per element, free
  in these memory-bound kernels).
* :func:`tuned` wraps a kernel in :func:`triton.autotune` for the GPU and keeps the plain kernel for
  the interpreter, which runs programs one after another and would time every configuration.

Example::

    if use_triton_for(x):
        kernel = tuned(_my_kernel, CONFIGS, key=["N"])
        kernel.launch(grid, x, ..., N=n, interpreter_meta={"BLOCK_M": 16, "num_warps": 4})
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Sequence

import torch
import triton
import triton.language as tl

from schedlang.kernels.multi_tensor_apply import interpreting

__all__ = ["use_triton_for", "interpreting", "cast_rounded", "triton_dtype", "TunedKernel", "tuned",
           "next_power_of_2", "sm_count", "as_rows"]

_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def use_triton_for(*tensors: Optional[torch.Tensor], while_compiling: bool = False) -> bool:
    """True when the Triton kernels should run on ``tensors``: all plain tensors (not DTensors or
    other subclasses) on one CUDA device, or all on the CPU under the interpreter, of a dtype the
    kernels handle (fp32, bf16, fp16), and not while torch.compile traces: there the reference is
    traced instead, and Inductor fuses it with its neighbours rather than breaking the graph.
    ``while_compiling=True`` asks about a kernel wrapped as a custom operator, which Inductor calls
    from its generated code: then the answer does not depend on tracing."""
    present = [t for t in tensors if t is not None]
    if not present or any(t.dtype not in _TRITON_DTYPES for t in present):
        return False
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in present):
        return False
    if torch.compiler.is_compiling() and not while_compiling:
        return False
    devices = {t.device.type for t in present}
    if devices == {"cuda"}:
        return len({t.device for t in present}) == 1
    return devices == {"cpu"} and interpreting()


def triton_dtype(dtype: torch.dtype):
    """The Triton dtype of a torch floating dtype (fp32, bf16, fp16)."""
    return _TRITON_DTYPES[dtype]


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 under the interpreter: few programs run fastest there)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``(rows, last dim)`` tensor whose last dimension is contiguous (a view when possible)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if rows.shape[-1] > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows


@triton.jit
def cast_rounded(x, DTYPE: tl.constexpr):
    """fp32 ``x`` converted to DTYPE, rounded to nearest even (also under the interpreter)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        # a NaN stays a NaN (the carry above could turn it into an infinity)
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


class TunedKernel:
    """A Triton kernel autotuned on the GPU over ``configs`` (keyed on ``key``), and launched with a
    fixed configuration under the interpreter."""

    def __init__(self, kernel, configs: Sequence[triton.Config], key: List[str],
                 prune: Optional[Callable] = None):
        self.kernel = kernel
        prune_by = {"early_config_prune": prune} if prune is not None else None
        self.autotuned = triton.autotune(configs=list(configs), key=key, prune_configs_by=prune_by)(kernel)

    def launch(self, grid, *args, interpreter_meta: Dict, **kwargs):
        """Launch on ``grid`` (a callable of the meta-parameters, or a tuple). On the GPU the
        autotuner picks the tuned meta-parameters; under the interpreter ``interpreter_meta`` is used."""
        if interpreting():
            meta = dict(interpreter_meta)
            g = grid(meta) if callable(grid) else grid
            return self.kernel[g](*args, **kwargs, **meta)
        return self.autotuned[grid](*args, **kwargs)


def tuned(kernel, configs: Sequence[triton.Config], key: List[str], prune: Optional[Callable] = None) -> TunedKernel:
    return TunedKernel(kernel, configs, key, prune)

"""Fusion compilers: the backends behind ``Schedule.fuse(subgraph, compiler=..., name=...)``.

:func:`lower_subgraph` turns an extracted FX subgraph into one module:

* ``"triton"``: generated Triton kernels for the forward and the backward
  (pointwise ops with broadcasting, reductions over the last dimension: LayerNorm,
  RMSNorm, softmax, sum/mean; dropout);
* ``"inductor"``: ``torch.compile(fullgraph=True)`` of the subgraph (any PyTorch op);
* ``"eager"``: the subgraph run as plain PyTorch (for debugging);
* ``"torchscript"`` (Slapo's ``"TorchScript"``): ``torch.jit.script`` of the subgraph, a real
  ``ScriptModule`` (``"inductor"`` where TorchScript cannot compile it).

Slapo's ``compiler=None`` (no compiler: the subgraph's modules gathered in one container) is handled
by ``fuse`` itself (:func:`schedlang.graph.subgraph.fuse_subgraphs`).

Triton is imported only when the triton compiler is used.

Example::

    import torch, torch.nn.functional as F
    from schedlang.lowering import lower_subgraph

    gm = torch.fx.symbolic_trace(lambda x, bias: F.gelu(x + bias, approximate="tanh"))
    fused = lower_subgraph(gm, "triton", "BiasGeLU",
                           example_inputs=[torch.randn(8, 64), torch.randn(64)])
    print(fused.source)            # forward and backward kernels
"""

from __future__ import annotations

import warnings

import torch
import torch.fx

from ..errors import ScheduleTypeError, ScheduleValueError

__all__ = ["lower_subgraph", "normalize_compiler", "COMPILERS"]

#: The compilers ``lower_subgraph`` accepts, in the order they are suggested.
COMPILERS = ("triton", "inductor", "eager", "torchscript")
_ALIASES: dict = {}


def normalize_compiler(compiler) -> str:
    """The canonical compiler name for ``compiler`` (case-insensitive); anything that is not a
    known compiler raises :class:`~schedlang.errors.ScheduleValueError`.

    >>> normalize_compiler("Triton")
    'triton'
    """
    if not isinstance(compiler, str):
        raise ScheduleTypeError(f"fuse: compiler must be a string, got {compiler!r} ({type(compiler).__name__}): "
                                f"valid compilers are {', '.join(repr(c) for c in COMPILERS)}")
    key = compiler.strip().lower()
    if key in _ALIASES:
        warnings.warn(f"compiler={compiler!r} is deprecated (TorchScript/nvFuser are gone from PyTorch 2.x): "
                      f"using compiler='{_ALIASES[key]}' (torch.compile) instead", DeprecationWarning, stacklevel=3)
        return _ALIASES[key]
    if key not in COMPILERS:
        raise ScheduleValueError(f"fuse: unknown compiler {compiler!r}: valid compilers are "
                                 f"{', '.join(repr(c) for c in COMPILERS)}, or None (no compiler: the subgraph's "
                                 "modules in one container)")
    return key


def lower_subgraph(gm: torch.fx.GraphModule, compiler: str, name: str, example_inputs=None) -> torch.nn.Module:
    """Compile an extracted subgraph into one module.

    Args:
        gm: a standalone GraphModule; its placeholders are the subgraph's tensor inputs and
            its output is one tensor or a tuple of tensors.
        compiler: ``"triton"``, ``"inductor"``, ``"eager"`` or ``"torchscript"`` (any case).
        name: the module's name (shown by ``print(model)``; names the generated kernels).
        example_inputs: optional tensors (or fake tensors) for the placeholders. With them
            (or with shapes recorded in the placeholders' ``meta``) the triton compiler
            generates its kernels now, so shape-dependent errors surface here and
            ``fused.source`` is available before the first call.

    Returns:
        An ``nn.Module`` whose ``forward`` takes the subgraph's inputs and returns its
        outputs; it owns the subgraph's parameters under their original local names and
        exposes ``source`` (for triton: the generated forward and backward kernels).

    Raises:
        ScheduleValueError: unknown compiler (the message lists the valid ones).
        LoweringError: (triton) operations without a lowering, all listed, with the
            compilers that take any PyTorch op.

    Example::

        gm = torch.fx.symbolic_trace(lambda x, b: torch.tanh(x * b))
        fused = lower_subgraph(gm, "triton", "TanhScale")
        y = fused(torch.randn(4, 8, device="cuda"), torch.randn(8, device="cuda"))
    """
    compiler = normalize_compiler(compiler)
    if not isinstance(gm, torch.fx.GraphModule):
        raise ScheduleTypeError(f"lower_subgraph: expects a torch.fx.GraphModule, got {type(gm).__name__}")
    if not isinstance(name, str) or not name.isidentifier():
        raise ScheduleValueError(f"fuse: fused module name must be a Python identifier, got {name!r}")
    if compiler == "triton":
        from . import triton_backend as backend
    elif compiler == "inductor":
        from . import inductor as backend
    elif compiler == "torchscript":
        from . import torchscript as backend
    else:
        from . import eager as backend
    return backend.lower(gm, name, example_inputs)

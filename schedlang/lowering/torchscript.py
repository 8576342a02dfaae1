"""``compiler="TorchScript"``: the extracted subgraph scripted with ``torch.jit.script``, as Slapo did.

TorchScript is in maintenance in PyTorch 2.x and fuses little on its own (Slapo paired it with nvFuser,
which is gone); ``"triton"`` or ``"inductor"`` generate real kernels. It is kept for scripts that ask
for it: the result is a real ``torch.jit.ScriptModule``. A subgraph TorchScript cannot compile is
lowered by ``"inductor"`` instead, with a warning that says why.

Example::

    fused = lower_subgraph(gm, "torchscript", "BiasGeLU")
    assert isinstance(fused, torch.jit.ScriptModule)
"""

from __future__ import annotations

import logging
import warnings

import torch

__all__ = ["lower"]

logger = logging.getLogger("schedlang.lowering.torchscript")


def lower(gm: torch.fx.GraphModule, name: str, example_inputs=None) -> torch.nn.Module:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch's own notice that TorchScript is deprecated
            return torch.jit.script(gm)
    except Exception as e:  # an op or a Python construct TorchScript does not take
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(f"fuse {name}: TorchScript cannot compile the subgraph ({reason}); lowered with "
                      "compiler='inductor' instead", UserWarning, stacklevel=4)
        from . import inductor

        return inductor.lower(gm, name, example_inputs)

"""``compiler="inductor"``: the extracted subgraph compiled by ``torch.compile`` (TorchInductor).

The subgraph is compiled with ``fullgraph=True`` at its first call (forward and, through
AOTAutograd, backward), and recompiled by torch.compile's own guards when shapes or dtypes
change. This is also what Slapo's ``compiler="TorchScript"`` maps to.

Example::

    fused = lower_subgraph(gm, "inductor", "BiasGeLU")
    y = fused(x, b)          # compiles on first call
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .fused_module import FusedSubgraph

__all__ = ["InductorFusedSubgraph"]


class InductorFusedSubgraph(FusedSubgraph):
    """Runs the subgraph through ``torch.compile(fullgraph=True)``."""

    compiler = "inductor"

    def __init__(self, gm, name):
        super().__init__(gm, name)
        self.__dict__["_compiled"] = None

    def _compiled_fn(self):
        if self.__dict__.get("_compiled") is None:
            self.__dict__["_compiled"] = torch.compile(self.graph_module, fullgraph=True)
        return self.__dict__["_compiled"]

    def forward(self, *args):
        self._check_arity(args)
        if torch.compiler.is_compiling() or (args and isinstance(args[0], FakeTensor)):
            # inside a compiled region (compile_layers) the enclosing graph takes the subgraph in and
            # Inductor fuses it there; a nested compiled callable would only add guards and
            # recompilations. Fake inputs ask for shapes only (tracing): no compilation for that.
            return self.graph_module(*args)
        return self._compiled_fn()(*args)

    def __deepcopy__(self, memo):
        # a compiled callable is not copied: the copy compiles its own on first use
        import copy

        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            clone.__dict__[key] = None if key == "_compiled" else copy.deepcopy(value, memo)
        return clone

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_compiled"] = None
        return state

    @property
    def source(self) -> str:
        return ("# compiled by torch.compile(fullgraph=True) at the first call; the subgraph:\n"
                + self.graph_module.code)


def lower(gm: torch.fx.GraphModule, name: str, example_inputs=None) -> InductorFusedSubgraph:
    return InductorFusedSubgraph(gm, name)

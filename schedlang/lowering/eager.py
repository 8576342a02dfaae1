"""``compiler="eager"``: the extracted subgraph run as plain PyTorch (for debugging a fusion).

Example::

    fused = lower_subgraph(gm, "eager", "BiasGeLU")
    torch.testing.assert_close(fused(x, b), gm(x, b))
"""

from __future__ import annotations

import torch

from .fused_module import FusedSubgraph

__all__ = ["EagerFusedSubgraph"]


class EagerFusedSubgraph(FusedSubgraph):
    """Runs the subgraph op by op, exactly as the unfused model did."""

    compiler = "eager"

    def forward(self, *args):
        self._check_arity(args)
        return self.graph_module(*args)


def lower(gm: torch.fx.GraphModule, name: str, example_inputs=None) -> EagerFusedSubgraph:
    return EagerFusedSubgraph(gm, name)

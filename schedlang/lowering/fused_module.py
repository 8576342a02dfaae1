"""The module that replaces a fused subgraph, whatever compiler runs it.

A :class:`FusedSubgraph` is an ``nn.Module`` whose ``forward`` takes the subgraph's inputs
(its placeholders, in order). It shows up under the name given to ``fuse`` when the model
is printed, and it owns the subgraph's parameters under their original local names (a
fused ``nn.LayerNorm`` called ``ln`` keeps ``ln.weight``), so optimizers, state dicts and
Verify see the same tensors as before fusion.

Example::

    gm = torch.fx.symbolic_trace(lambda x, b: F.gelu(x + b))
    fused = lower_subgraph(gm, "eager", "BiasGeLU")
    print(fused)        # BiasGeLU(compiler='eager', inputs=(x, b), outputs=(gelu,) ...)
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from .translate import format_node

__all__ = ["FusedSubgraph"]


class FusedSubgraph(nn.Module):
    """Base class of the modules returned by :func:`schedlang.lowering.lower_subgraph`."""

    compiler = "?"

    def __init__(self, gm: torch.fx.GraphModule, name: str):
        super().__init__()
        # the GraphModule is kept outside the module tree: its children and tensors are
        # registered on this module directly, under the same names, so each parameter
        # appears once (fused.ln.weight, not fused.graph_module.ln.weight)
        self.__dict__["_graph_module"] = gm
        self.name = name
        for child_name, child in gm.named_children():
            self.add_module(child_name, child)
        for pname, param in gm.named_parameters(recurse=False):
            self.register_parameter(pname, param)
        for bname, buf in gm.named_buffers(recurse=False):
            self.register_buffer(bname, buf, persistent=bname not in getattr(gm, "_non_persistent_buffers_set", ()))
        for node in gm.graph.nodes:  # plain tensor constants (not parameters or buffers)
            if node.op == "get_attr" and "." not in node.target and not hasattr(self, node.target):
                value = getattr(gm, node.target, None)
                if isinstance(value, torch.Tensor):
                    self.register_buffer(node.target, value, persistent=False)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.input_names = [n.name for n in placeholders]
        self._required_inputs = sum(1 for n in placeholders if not n.args)  # the rest have defaults
        output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        outs = output if isinstance(output, (tuple, list)) else (output,)
        self.output_names = [o.name if isinstance(o, torch.fx.Node) else repr(o) for o in outs]

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The extracted subgraph as a GraphModule (shares this module's parameters)."""
        return self._graph_module

    def _get_name(self) -> str:
        return self.name

    def extra_repr(self) -> str:
        head = (f"compiler={self.compiler!r}, inputs=({', '.join(self.input_names)}), "
                f"outputs=({', '.join(self.output_names)}{',' if len(self.output_names) == 1 else ''})")
        body = [format_node(n, self.graph_module) for n in self.graph_module.graph.nodes
                if n.op.startswith("call_")]
        return "\n".join([head] + [f"  {line}" for line in body])

    @property
    def source(self) -> str:
        """The code that runs: for 'eager' and 'inductor' the subgraph's Python code."""
        return self.graph_module.code

    def _check_arity(self, args):
        if not self._required_inputs <= len(args) <= len(self.input_names):
            from ..errors import ScheduleTypeError

            raise ScheduleTypeError(
                f"{self.name}: expected {len(self.input_names)} inputs ({', '.join(self.input_names)}), "
                f"got {len(args)}")

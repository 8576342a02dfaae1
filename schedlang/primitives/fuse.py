"""``fuse(subgraph, compiler="triton", name="FusedModule")``: vertical fusion.

Each subgraph found by ``find`` becomes one submodule ``<name>_<k>`` of the traced module
holding it, compiled by :func:`schedlang.lowering.lower_subgraph`: ``"triton"``
(generated forward and backward kernels), ``"inductor"`` (``torch.compile``),
``"eager"`` (the same ops, for debugging) or Slapo's ``"TorchScript"`` (``torch.jit.script``: a real
``ScriptModule``). The graph then calls the new module where the subgraph was. Slapo's
``compiler=None`` compiles nothing: the subgraph's own modules move into one container of class
``name`` (children ``"0"``, ``"1"`` ... in call order), whose forward runs the subgraph.

Parameters the subgraph reads stay where they are: their ``get_attr`` nodes remain in
the parent graph and are passed to the fused module (a fused ``nn.Linear`` or
``nn.LayerNorm`` becomes its functional form with its weights as inputs), so names,
shards and the optimizer see the same tensors. A subgraph whose removal would create a
cycle (a value leaves it and comes back) is refused.

Example::

    sch.trace(flatten=True)
    sch.fuse(sch.find(lambda x, b: F.gelu(x + b)), compiler="triton", name="BiasGeLU")
"""

from __future__ import annotations

from typing import Any, Optional

from .base import Param, Primitive, register_primitive
from .params import SUBGRAPHS

__all__ = ["Fuse"]


@register_primitive
class Fuse(Primitive):
    """Fuse a found subgraph into one submodule lowered by ``compiler`` (``triton``,
    ``inductor`` or ``eager``).

    Example::

        sch["mlp"].fuse(subgraphs, compiler="triton", name="BiasGeLU")
    """

    name = "fuse"
    params = (
        Param("subgraph", Any, doc="subgraphs found in this traced module by find()", codec=SUBGRAPHS),
        Param("compiler", Optional[str], "triton",
              "'triton', 'inductor', 'eager', 'torchscript', or None: no compiler (the subgraph's modules in one "
              "container of class `name`, Slapo's fallback)"),
        Param("name", str, "FusedModule", "name of the new submodules (name_0, name_1 ...)"),
    )

    @classmethod
    def validate(cls, sch, subgraph, compiler="triton", name="FusedModule"):
        from ..graph.subgraph import _check_name, require_traced, validate_subgraphs
        from ..lowering import normalize_compiler

        where = sch.path or "<root>"
        require_traced(sch, "fuse")
        compiler = None if compiler is None else normalize_compiler(compiler)
        _check_name(where, name, "fuse")
        return {"subgraph": validate_subgraphs(sch, subgraph, "fuse"), "compiler": compiler, "name": name}

    @classmethod
    def apply(cls, sch, subgraph, compiler="triton", name="FusedModule"):
        from ..graph.subgraph import fuse_subgraphs

        fuse_subgraphs(sch, subgraph, compiler, name)
        return None

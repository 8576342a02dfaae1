"""``fuse(subgraph, compiler="triton", name="FusedModule")``: vertical fusion.

Each subgraph found by ``find`` becomes one submodule ``<name>_<k>`` of the traced module
holding it, compiled by :func:`schedlang.lowering.lower_subgraph`: ``"triton"``
(generated forward and backward kernels), ``"inductor"`` (``torch.compile``) or
``"eager"`` (the same ops, for debugging); ``"TorchScript"`` is a deprecated alias of
``"inductor"``. The graph then calls the new module where the subgraph was.

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

from typing import Any

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
        Param("compiler", str, "triton", "'triton', 'inductor' or 'eager'"),
        Param("name", str, "FusedModule", "name of the new submodules (name_0, name_1 ...)"),
    )

    @classmethod
    def validate(cls, sch, subgraph, compiler="triton", name="FusedModule"):
        from ..graph.subgraph import _check_name, require_traced, validate_subgraphs
        from ..lowering import normalize_compiler

        where = sch.path or "<root>"
        require_traced(sch, "fuse")
        compiler = normalize_compiler(compiler)
        _check_name(where, name, "fuse")
        return {"subgraph": validate_subgraphs(sch, subgraph, "fuse"), "compiler": compiler, "name": name}

    @classmethod
    def apply(cls, sch, subgraph, compiler="triton", name="FusedModule"):
        from ..graph.subgraph import fuse_subgraphs

        fuse_subgraphs(sch, subgraph, compiler, name)
        return None

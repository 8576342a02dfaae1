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

from .base import Primitive, register_primitive

__all__ = ["Fuse"]


@register_primitive
class Fuse(Primitive):
    name = "fuse"

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

    @classmethod
    def encode_args(cls, args, step_index, path):
        from ..graph.subgraph import encode_subgraphs

        return super().encode_args(dict(args, subgraph=encode_subgraphs(args["subgraph"])), step_index, path)

    @classmethod
    def decode_args(cls, data):
        from ..graph.subgraph import decode_subgraphs

        return dict(data, subgraph=decode_subgraphs(data["subgraph"]))

    @classmethod
    def replay_args(cls, args):
        from ..graph.subgraph import decode_subgraphs, encode_subgraphs

        return dict(args, subgraph=decode_subgraphs(encode_subgraphs(args["subgraph"])))

    @classmethod
    def describe_args(cls, args):
        n = len(args["subgraph"])
        nodes = ", ".join("+".join(node.name if hasattr(node, "name") else str(node) for _, node in sg)
                          for sg in args["subgraph"][:3])
        more = ", ..." if n > 3 else ""
        return f"{n} subgraph{'s' if n != 1 else ''} [{nodes}{more}], compiler={args['compiler']!r}, " \
               f"name={args['name']!r}"

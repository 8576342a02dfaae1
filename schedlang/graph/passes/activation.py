"""Rule ``activation``: the same pointwise activation over a group of tensors becomes one op.

Activations: tanh, relu, sigmoid, gelu (either approximation), silu, as functions
(``torch.tanh``, ``F.gelu`` ...), methods (``x.relu()``) or modules (``nn.ReLU()`` ...).
In-place forms are left alone.

Two shapes of group:

* every used piece of one split/unbind goes through the activation: apply it once to the
  split's input and split the result the same way::

      t0 = torch.tanh(unbind[0]); t1 = torch.tanh(unbind[1])    # unbind = y.unbind(-2)
      ->  tanh = torch.tanh(y); unbind_1 = tanh.unbind(-2); t0 = unbind_1[0]; t1 = unbind_1[1]

* otherwise (same-shape operands): stack, one activation, unbind. The last piece of an
  int split, whose size is not known (it may be shorter), is left out of the stack.
"""

from __future__ import annotations

import operator
from typing import Hashable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

from ._build import group_key, replace_by_stacked_call, stack_dim_for
from ._context import RewriteContext, Rule
from ._nodes import NUM_PIECES_META, arg, module_of, piece_of, plain_module

__all__ = ["ActivationGroup", "activation_of"]

_FUNCTIONS = {torch.tanh: "tanh", F.tanh: "tanh", torch.relu: "relu", F.relu: "relu", torch.sigmoid: "sigmoid",
              F.sigmoid: "sigmoid", F.gelu: "gelu", F.silu: "silu"}
_METHODS = {"tanh": "tanh", "relu": "relu", "sigmoid": "sigmoid"}
_MODULES = {nn.Tanh: "tanh", nn.ReLU: "relu", nn.Sigmoid: "sigmoid", nn.GELU: "gelu", nn.SiLU: "silu"}
_EMIT = {"tanh": torch.tanh, "relu": torch.relu, "sigmoid": torch.sigmoid, "gelu": F.gelu, "silu": F.silu}


def activation_of(ctx: RewriteContext, node: fx.Node) -> Optional[Tuple[fx.Node, Tuple]]:
    """(operand, signature) of a fusable activation node; the signature is (name, approximate)."""
    if node.op == "call_function" and node.target in _FUNCTIONS:
        name = _FUNCTIONS[node.target]
        x = arg(node, 0, "input")
        extra = set(node.kwargs) - {"input", "inplace", "approximate"}
        if extra or len(node.args) > (2 if name in ("relu", "silu", "gelu") else 1):
            return None
        if name in ("relu", "silu") and arg(node, 1, "inplace", False):
            return None
        approximate = arg(node, 1, "approximate", "none") if name == "gelu" else None
        if name == "gelu" and approximate not in ("none", "tanh"):
            return None
    elif node.op == "call_method" and node.target in _METHODS and len(node.args) == 1 and not node.kwargs:
        name, x, approximate = _METHODS[node.target], node.args[0], None
    elif node.op == "call_module":
        module = module_of(ctx, node)
        kind = type(module) if module is not None else None
        if kind not in _MODULES or not plain_module(module, kind) or len(node.args) != 1 or node.kwargs:
            return None
        if getattr(module, "inplace", False):
            return None
        name, x = _MODULES[kind], node.args[0]
        approximate = module.approximate if name == "gelu" else None
    else:
        return None
    if not isinstance(x, fx.Node):
        return None
    return x, (name, approximate)


def _emit(ctx: RewriteContext, signature: Tuple, x: fx.Node) -> fx.Node:
    name, approximate = signature
    if name == "gelu" and approximate != "none":
        return ctx.call(F.gelu, x, approximate=approximate)
    return ctx.call(_EMIT[name], x)


class ActivationGroup(Rule):
    name = "activation"
    description = "one pointwise activation over a group (pieces of a split, or same-shape tensors) -> one op"
    needs_independence = True

    operands = staticmethod(activation_of)

    def group_of(self, ctx: RewriteContext, x: fx.Node, signature: Tuple) -> Optional[Hashable]:
        piece = piece_of(x)
        key = ("split", piece.spec.node) if piece is not None else group_key(ctx, x)
        return None if key[0] == "node" else (key, signature)

    def rewrite(self, ctx: RewriteContext, key: Hashable, members: List[fx.Node]) -> bool:
        found = [activation_of(ctx, m) for m in members]
        inputs = [f[0] for f in found]
        signature = found[0][1]
        label = signature[0] if signature[1] in (None, "none") else f"{signature[0]}({signature[1]})"
        pieces = [piece_of(x) for x in inputs]
        if all(p is not None for p in pieces) and len({p.spec.node for p in pieces}) == 1:
            spec = pieces[0].spec
            used = {u.args[1] for u in spec.node.users if u.op == "call_function" and u.target is operator.getitem}
            if {p.index for p in pieces} >= used or {p.node.args[1] for p in pieces} >= used:
                with ctx.graph.inserting_before(members[0]):
                    y = _emit(ctx, signature, spec.base)
                    args = (y,) + tuple(spec.node.args[1:]) if spec.node.args and spec.node.args[0] is spec.base \
                        else spec.node.args
                    kwargs = {k: (y if v is spec.base else v) for k, v in spec.node.kwargs.items()}
                    parts = ctx.node(spec.node.op, spec.node.target, args, kwargs,
                                     num_pieces=spec.node.meta.get(NUM_PIECES_META))
                    outs = [ctx.call(operator.getitem, parts, p.node.args[1]) for p in pieces]
                ctx.record(self.name, members, y, f"{len(members)} x {label} on the pieces of '{spec.node.name}' "
                                                  f"-> 1 {label} on '{spec.base.name}' + {spec.kind}")
                for m, out in zip(members, outs):
                    ctx.replace(m, out)
                return True
            if spec.kind == "split":
                # an int split's last piece of unknown size may be shorter: it stays apart, the others stack
                kept = [i for i, p in enumerate(pieces) if p.size is not None]
                if len(kept) < ctx.min_group_size or len({pieces[i].size for i in kept}) != 1:
                    return False  # pieces of different sizes cannot be stacked
                members, inputs = [members[i] for i in kept], [inputs[i] for i in kept]
        dim = stack_dim_for(inputs, 0)
        n = len(members)
        replace_by_stacked_call(ctx, self.name, members, inputs, dim, lambda grouped: _emit(ctx, signature, grouped),
                                f"{n} x {label} -> 1 {label} over {n} stacked tensors")
        return True

"""Rule ``linear_same_input``: linears that read the same tensor become one GEMM and a split.

Before::

    a = self.q(x); b = self.k(x); c = F.linear(x, self.w_v, self.b_v)

After (weights concatenated along the output dimension into one new parameter)::

    y = torch._C._nn.linear(x, self.hfused_linear_weight_0, self.hfused_linear_bias_0)
    split = torch.split(y, [64, 64, 64], -1)
    a = split[0]; b = split[1]; c = split[2]

Candidates: ``nn.Linear`` modules (exactly that class, no hooks, not sharded) and
``F.linear`` calls whose weight (and bias) are module attributes. Key: the input node,
``in_features``, dtype/device, and whether there is a bias. Members that share one input
cannot depend on each other, so no reachability check is needed.
"""

from __future__ import annotations

import operator
from typing import Hashable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

from ._build import TensorRef, attr_ref, fuse_weights_and_biases, module_ref
from ._context import RewriteContext, Rule
from ._nodes import arg, is_call, module_of, plain_module

__all__ = ["LinearSameInput", "LinearRule", "linear_operands"]


def linear_operands(ctx: RewriteContext, node: fx.Node) -> Optional[Tuple[fx.Node, TensorRef, Optional[TensorRef]]]:
    """(input, weight, bias) of a fusable linear node, else None."""
    if node.op == "call_module":
        module = module_of(ctx, node)
        if module is None or not plain_module(module, nn.Linear) or len(node.args) != 1 or node.kwargs:
            return None
        x = node.args[0]
        weight = module_ref(ctx, node, "weight")
        bias = module_ref(ctx, node, "bias") if module.bias is not None else None
    elif is_call(node, (F.linear,)):
        x = arg(node, 0, "input")
        weight = attr_ref(ctx, arg(node, 1, "weight"))
        b = arg(node, 2, "bias")
        bias = None if b is None else attr_ref(ctx, b)
        if b is not None and bias is None:
            return None
    else:
        return None
    if not isinstance(x, fx.Node) or weight is None or weight.value.dim() != 2:
        return None
    if bias is not None and (bias.value.dim() != 1 or bias.value.dtype != weight.value.dtype
                             or bias.value.requires_grad != weight.value.requires_grad):
        return None
    return x, weight, bias


def linear_signature(weight: TensorRef, bias: Optional[TensorRef]) -> Tuple:
    w = weight.value
    return (w.shape[1], w.dtype, w.device, w.requires_grad, bias is not None)


class LinearRule(Rule):
    """A rule over linears (``nn.Linear`` modules, ``F.linear`` calls): operands ``(x, weight, bias)``."""

    operands = staticmethod(linear_operands)


class LinearSameInput(LinearRule):
    name = "linear_same_input"
    description = "linears sharing an input -> one GEMM on concatenated weights + split"
    needs_independence = False

    def group_of(self, ctx: RewriteContext, x, weight, bias) -> Optional[Hashable]:
        return (x,) + linear_signature(weight, bias)

    def rewrite(self, ctx: RewriteContext, key: Hashable, members: List[fx.Node]) -> bool:
        operands = [linear_operands(ctx, m) for m in members]
        x = operands[0][0]
        weights = [o[1] for o in operands]
        biases = [o[2] for o in operands]
        sizes = [w.value.shape[0] for w in weights]
        with ctx.graph.inserting_before(members[0]):
            w, b = fuse_weights_and_biases(ctx, "linear", weights, biases, "cat")
            y = ctx.call(F.linear, x, w, b)
            parts = ctx.call(torch.split, y, sizes, -1)
            outs = [ctx.call(operator.getitem, parts, i) for i in range(len(members))]
        ctx.record(self.name, members, y,
                   f"{len(members)} x linear({weights[0].value.shape[1]}->[{_sizes(sizes)}]) on '{x.name}' "
                   f"-> 1 linear({weights[0].value.shape[1]}->{sum(sizes)}) + split")
        for m, out in zip(members, outs):
            ctx.replace(m, out)
        return True


def _sizes(sizes: List[int]) -> str:
    if len(set(sizes)) == 1:
        return f"{sizes[0]}"
    return ",".join(map(str, sizes[:8])) + (",..." if len(sizes) > 8 else "")

"""Rule ``layer_norm``: layer norms over the pieces of one split (or same-shape inputs) become one.

Before (seed case: an embedding output cut into N features of width D)::

    split = x.split(64, -1)
    n0 = self.ln0(split[0]); n1 = self.ln1(split[1]); ...

After: one normalization over a ``(B, N, D)`` stack, one affine step with stacked
``(N, D)`` weight and bias::

    stacked = torch.stack([split[0], split[1], ...], -2)     # a view after stack_unbind
    y = group_ops.group_layer_norm(stacked, (64,), self.hfused_ln_weight_0, self.hfused_ln_bias_0, 1e-05, -2)
    unbind = y.unbind(-2)
    n0 = unbind[0]; ...

Without shapes, the last piece of an int split (``x.split(64, 1)``) may be shorter than
the others, so it cannot be stacked with them. When the group is every piece
``0 .. N-1`` of the split, once each, the rule emits instead::

    y = group_ops.piecewise_layer_norm(x, 64, 1, N, (64,), self.hfused_ln_weight_0, self.hfused_ln_bias_0, 1e-05)
    split_1 = y.split(64, 1)
    n0 = split_1[0]; ...

which checks at run time that all N pieces are whole (then: one group layer norm on a
view) and otherwise normalizes each piece on its own, exactly as before. Otherwise that
last piece stays apart and the others are stacked.

Candidates: ``nn.LayerNorm`` (exact class, no hooks) and ``F.layer_norm`` whose weight
and bias are module attributes or None. Key: operand shape/split, normalized shape,
eps, which affine parameters exist, their dtype/device.
"""

from __future__ import annotations

from typing import Hashable, List, Optional, Tuple

import torch.nn.functional as F
from torch import fx, nn

from . import group_ops
from ._build import (
    TensorRef,
    attr_ref,
    fuse_weights_and_biases,
    group_key,
    module_ref,
    piece_order,
    replace_by_pieces,
    replace_by_stacked_call,
    settled_members,
    stack_dim_for,
    unsettled,
)
from ._context import RewriteContext, Rule
from ._nodes import NUM_PIECES_META, arg, every_piece_once, is_call, module_of, piece_of, plain_module

__all__ = ["LayerNormGroup"]

_Operands = Tuple[fx.Node, Tuple[int, ...], float, Optional[TensorRef], Optional[TensorRef]]


def layer_norm_operands(ctx: RewriteContext, node: fx.Node) -> Optional[_Operands]:
    """(input, normalized_shape, eps, weight, bias) of a fusable layer norm node."""
    if node.op == "call_module":
        module = module_of(ctx, node)
        if module is None or not plain_module(module, nn.LayerNorm) or len(node.args) != 1 or node.kwargs:
            return None
        x = node.args[0]
        shape, eps = tuple(module.normalized_shape), module.eps
        weight = module_ref(ctx, node, "weight") if module.weight is not None else None
        bias = module_ref(ctx, node, "bias") if module.bias is not None else None
    elif is_call(node, (F.layer_norm,)):
        x = arg(node, 0, "input")
        shape = arg(node, 1, "normalized_shape")
        shape = (shape,) if type(shape) is int else shape
        if not isinstance(shape, (tuple, list)) or not all(type(s) is int for s in shape):
            return None
        shape = tuple(shape)
        eps = arg(node, 4, "eps", 1e-5)
        w, b = arg(node, 2, "weight"), arg(node, 3, "bias")
        weight = None if w is None else attr_ref(ctx, w)
        bias = None if b is None else attr_ref(ctx, b)
        if (w is not None and weight is None) or (b is not None and bias is None) or not isinstance(eps, float):
            return None
    else:
        return None
    if not isinstance(x, fx.Node) or not shape:
        return None
    for ref in (weight, bias):
        if ref is not None and tuple(ref.value.shape) != shape:
            return None
    return x, shape, eps, weight, bias


def _param_signature(ref: Optional[TensorRef]):
    return None if ref is None else (ref.value.dtype, ref.value.device, ref.value.requires_grad)


class LayerNormGroup(Rule):
    name = "layer_norm"
    description = "layer norms over pieces of one split / same-shape inputs -> one layer norm on a (B, N, D) view"
    needs_independence = True

    operands = staticmethod(layer_norm_operands)

    def group_of(self, ctx: RewriteContext, x, shape, eps, weight, bias) -> Optional[Hashable]:
        key = group_key(ctx, x, _last_dim(shape), short_pieces=True)
        if key[0] == "node":
            return None
        return (key, shape, eps, _param_signature(weight), _param_signature(bias))

    def rewrite(self, ctx: RewriteContext, key: Hashable, members: List[fx.Node]) -> bool:
        operands = [layer_norm_operands(ctx, m) for m in members]
        last_dim = _last_dim(operands[0][1])
        if any(unsettled(o[0], last_dim) for o in operands):
            if every_piece_once([o[0] for o in operands]):
                return self._rewrite_piecewise(ctx, members, operands)
            settled = settled_members(ctx, members, operands, last_dim)
            if settled is None:
                return False
            members, operands = settled
        inputs = [o[0] for o in operands]
        shape, eps = operands[0][1], operands[0][2]
        weights = [o[3] for o in operands]
        biases = [o[4] for o in operands]
        k = len(shape)
        dim = stack_dim_for(inputs, -(k + 1))
        if not (dim == 0 or dim <= -(k + 1)):
            dim = -(k + 1)
        n = len(members)
        with ctx.graph.inserting_before(members[0]):
            w, b = fuse_weights_and_biases(ctx, "ln", weights, biases, "stack")
        replace_by_stacked_call(ctx, self.name, members, inputs, dim,
                                lambda grouped: ctx.call(group_ops.group_layer_norm, grouped, shape, w, b, eps, dim),
                                f"{n} x layer_norm{shape} -> 1 group_layer_norm over {n} stacked pieces")
        return True

    def _rewrite_piecewise(self, ctx: RewriteContext, members: List[fx.Node], operands: List[_Operands]) -> bool:
        """Every piece of an int split, whose last piece may be shorter -> one guarded piecewise layer norm."""
        order = piece_order([o[0] for o in operands])
        spec = piece_of(operands[0][0]).spec
        shape, eps = operands[0][1], operands[0][2]
        weights = [operands[i][3] for i in order]
        biases = [operands[i][4] for i in order]
        n = len(members)
        with ctx.graph.inserting_before(members[0]):
            w, b = fuse_weights_and_biases(ctx, "ln", weights, biases, "stack")
            y = ctx.call(group_ops.piecewise_layer_norm, spec.base, spec.sizes, spec.dim, n, shape, w, b, eps)
        replace_by_pieces(ctx, self.name, members, order, y, spec, spec.node.meta.get(NUM_PIECES_META),
                          f"{n} x layer_norm{shape} on the pieces of '{spec.node.name}' -> 1 piecewise_layer_norm on "
                          f"'{spec.base.name}' (one group layer norm when all {n} pieces are whole, else one per piece)")
        return True


def _last_dim(shape: Tuple[int, ...]) -> Optional[int]:
    """The size a layer norm requires of its input's last dim, when it normalizes one dim."""
    return shape[-1] if len(shape) == 1 else None

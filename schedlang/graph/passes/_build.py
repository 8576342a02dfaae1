"""Building blocks shared by the fusion rules: fused parameters, stacking and unstacking."""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import fx

from ._context import ParamSource, RewriteContext
from ._nodes import piece_of, settled_size, shape_key

__all__ = ["TensorRef", "attr_ref", "module_ref", "fuse_tensors", "stack", "unstack", "group_key", "unsettled",
           "piece_order", "replace_by_pieces",
           "stack_dim_for"]


@dataclass(frozen=True)
class TensorRef:
    """A parameter a member uses: a get_attr node, or ``<module target>.<name>`` of a called module.

    ``exclusive`` says the member is its only user, so it may be moved into a fused parameter.
    """

    target: str
    node: Optional[fx.Node]
    value: torch.Tensor
    exclusive: bool


def attr_ref(ctx: RewriteContext, node: fx.Node) -> Optional[TensorRef]:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = ctx.tensor(node.target)
    if not isinstance(value, torch.Tensor):
        return None
    return TensorRef(node.target, node, value, ctx.exclusive_attr(node))


def module_ref(ctx: RewriteContext, member: fx.Node, name: str) -> Optional[TensorRef]:
    value = getattr(ctx.get_submodule(member.target), name, None)
    if value is None:
        return None
    return TensorRef(f"{member.target}.{name}", None, value, ctx.exclusive_module(member))


def fuse_tensors(ctx: RewriteContext, hint: str, refs: Sequence[TensorRef], how: str, dim: int) -> fx.Node:
    """One tensor holding ``refs`` concatenated (``how="cat"``) or stacked along ``dim``.

    When every member owns its parameter, the result is a new parameter initialized from
    the originals (they are deleted at commit once unused). Otherwise the graph
    concatenates the originals on every call, which keeps shared (tied) weights shared.
    """
    if all(r.exclusive for r in refs):
        values = [r.value.detach() for r in refs]
        value = torch.cat(values, dim) if how == "cat" else torch.stack(values, dim)
        sources: List[ParamSource] = []
        offset = 0
        for r in refs:
            if how == "cat":
                length = r.value.shape[dim]
                sources.append(ParamSource(r.target, (("narrow", dim, offset, length),), weakref.ref(r.value)))
                offset += length
            else:
                sources.append(ParamSource(r.target, (("select", dim, offset, 1),), weakref.ref(r.value)))
                offset += 1
        return ctx.new_parameter(f"hfused_{hint}", value, refs[0].value.requires_grad, sources)
    nodes = [r.node if r.node is not None else ctx.node("get_attr", r.target) for r in refs]
    return ctx.call(torch.cat if how == "cat" else torch.stack, nodes, dim)


def fuse_weights_and_biases(ctx: RewriteContext, prefix: str, weights: Sequence[Optional[TensorRef]],
                            biases: Sequence[Optional[TensorRef]], how: str) -> Tuple[Optional[fx.Node], Optional[fx.Node]]:
    """The members' weights and biases each joined by :func:`fuse_tensors` along dim 0 (``<prefix>_weight``,
    ``<prefix>_bias``); None for a kind the members do not have (the grouping makes them all alike)."""
    w = fuse_tensors(ctx, f"{prefix}_weight", weights, how, 0) if weights[0] is not None else None
    b = fuse_tensors(ctx, f"{prefix}_bias", biases, how, 0) if biases[0] is not None else None
    return w, b


def stack(ctx: RewriteContext, inputs: Sequence[fx.Node], dim: int) -> fx.Node:
    return ctx.call(torch.stack, list(inputs), dim)


def unstack(ctx: RewriteContext, grouped: fx.Node, dim: int, count: int) -> List[fx.Node]:
    """``grouped.unbind(dim)`` and one getitem node per piece."""
    parts = ctx.node("call_method", "unbind", (grouped, dim), num_pieces=count)
    return [ctx.call(operator.getitem, parts, i) for i in range(count)]


def group_key(ctx: RewriteContext, node: fx.Node, last_dim: Optional[int] = None, short_pieces: bool = False):
    """Grouping key of an operand: the split it is a piece of, else a same-shape key.

    Preferring the split keeps the pieces of one split together, which the round-trip
    rules then turn into a view of the split's input instead of a copy. With
    ``short_pieces``, an int split's last piece of unknown size (it may be shorter) joins
    the group of its whole siblings: the rule must then not stack it, but guard it (see
    :func:`unsettled`).
    """
    piece = piece_of(node)
    if piece is not None:
        if piece.spec.kind == "unbind":
            return ("pieces", piece.spec.node)
        size = settled_size(piece, last_dim)
        if size is None and short_pieces:
            size = piece.spec.sizes  # an int split (a list of sizes settles every piece)
        if size is not None:
            return ("pieces", piece.spec.node, size)
    return shape_key(node, ctx, last_dim)


def unsettled(node: fx.Node, last_dim: Optional[int] = None) -> bool:
    """Whether ``node`` is an int split's last piece whose size nothing settles (it may be shorter)."""
    piece = piece_of(node)
    return piece is not None and piece.spec.kind == "split" and settled_size(piece, last_dim) is None


def settled_members(ctx: RewriteContext, members: Sequence[fx.Node], operands: Sequence[Tuple], size: Optional[int]
                    ) -> Optional[Tuple[List[fx.Node], List[Tuple]]]:
    """The members whose input (``operands[i][0]``) is not a possibly shorter piece of a split (see
    :func:`unsettled`), with their operands: the shorter piece cannot be stacked, the others still can.
    None when fewer than the rule's minimum group size remain."""
    kept = [(m, o) for m, o in zip(members, operands) if not unsettled(o[0], size)]
    if len(kept) < ctx.min_group_size:
        return None
    return [m for m, _ in kept], [o for _, o in kept]


def replace_by_stacked_call(ctx: RewriteContext, rule: str, members: Sequence[fx.Node], inputs: Sequence[fx.Node],
                            dim: int, call: Callable[[fx.Node], fx.Node], description: str) -> None:
    """The group rewrite shared by the stacking rules: ``inputs`` stacked along ``dim``, ``call(stacked)`` the one
    grouped op, its result unbound along ``dim`` into one value per member, recorded under ``rule``, and each
    member replaced by its piece."""
    with ctx.graph.inserting_before(members[0]):
        grouped = stack(ctx, inputs, dim)
        y = call(grouped)
        outs = unstack(ctx, y, dim, len(members))
    ctx.record(rule, members, y, description)
    for member, out in zip(members, outs):
        ctx.replace(member, out)


def stack_dim_for(inputs: Sequence[fx.Node], default: int) -> int:
    """Where to put the group dimension when stacking ``inputs`` so a round trip can undo it.

    Pieces of one unbind along ``g`` go back to ``g``; pieces of a split along ``d < 0`` go
    right before ``d`` (then the stack is a view of the split's input).
    """
    pieces = [piece_of(i) for i in inputs]
    if pieces and all(p is not None for p in pieces) and len({p.spec.node for p in pieces}) == 1:
        spec = pieces[0].spec
        if spec.kind == "unbind":
            return spec.dim
        if spec.dim < 0:
            return spec.dim - 1
        return spec.dim
    return default


def piece_order(inputs: Sequence[fx.Node]) -> List[int]:
    """The positions of ``inputs`` (pieces of one split) sorted by piece index."""
    return sorted(range(len(inputs)), key=lambda i: piece_of(inputs[i]).index)


def replace_by_pieces(ctx: RewriteContext, rule: str, members: Sequence[fx.Node], order: Sequence[int], y: fx.Node,
                      spec, num_pieces: Optional[int], detail: str) -> None:
    """Cut ``y`` as ``spec``'s split cut its input and let member ``order[i]`` use piece ``i``; records the rewrite.

    ``y`` must have been made in front of ``members[0]``: the cut goes between the two."""
    with ctx.graph.inserting_before(members[0]):
        parts = ctx.node("call_method", "split", (y, spec.sizes, spec.dim), num_pieces=num_pieces)
        outs = [ctx.call(operator.getitem, parts, i) for i in range(len(members))]
    ordered = [members[i] for i in order]
    ctx.record(rule, ordered, y, detail)
    for m, out in zip(ordered, outs):
        ctx.replace(m, out)

"""Rule ``embedding_bags``: embedding bags over the pieces of a sparse-feature split -> one lookup.

Before (what the ``combine_sparse_features`` primitive makes of a model with one
``nn.EmbeddingBag`` per sparse feature; tables of R0, R1, ... rows, all D wide)::

    split = split_sparse_features(sparse_indices, sparse_lengths, 3)
    a_idx = split[0][0]; a_len = split[0][1]; b_idx = split[1][0]; ...
    a_off = torch.cat([a_len.new_zeros(1), a_len.cumsum(0)[:-1]])
    a = self.bag_a(a_idx, a_off); b = self.bag_b(b_idx, b_off); c = self.bag_c(c_idx, c_off)

After (tables concatenated along their rows into one new parameter)::

    pooled = pooled_embedding_bags(split, self.hfused_embedding_bag_weight_0,
                                   self.hfused_embedding_bag_rows_0, "sum")     # (3, B, D)
    parts = pooled.unbind(0)
    a = parts[0]; b = parts[1]; c = parts[2]

so the split's per-feature pieces are never made (they would cost a device-to-host copy
and 2N views, see :class:`schedlang.sparse.SparseFeatureSplit`). Feature ``f`` reads rows
``rows[f] + id`` of the fused table; ``hfused_embedding_bag_rows_*`` is a non-persistent
buffer of the N row offsets (-1 for a feature of the split that no member reads).

Candidates: ``nn.EmbeddingBag`` modules (exactly that class, no hooks, not sharded) and
``F.embedding_bag`` calls whose weight is a module attribute, with ``max_norm``,
``padding_idx`` and ``per_sample_weights`` None, ``scale_grad_by_freq`` and ``sparse``
False, whose input is the indices piece of feature ``f`` of a ``split_sparse_features``
node and whose offsets are computed from the lengths piece of the same feature only.
The offsets are recognized by what they compute, not by how: their nodes must be
prefix-sum and shape ops (``cumsum``, ``cat``, slicing, ``pad``, zeros, ``+``/``-``, dtype
casts), and evaluated on probe lengths of several batch sizes they must give each bag's
start (``include_last_offset=False``) or the starts and the total (``True``). Key: the
split node, the mode, the width, dtype and device of the table and whether it trains.
One member per feature: a second bag over the same feature waits for the next group.

Parameters follow the other rules (see ``_build.fuse_tensors``): when each table belongs
to its member only, the tables become one new parameter ``hfused_embedding_bag_weight_*``
whose sources say where each original lives (``fused_parameter_sources``), so every
original's gradient is a slice of the new one's; otherwise the graph concatenates the
original tables on every call, which keeps shared tables shared. A table read by
several members appears once.
"""

from __future__ import annotations

import builtins
import operator
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

from ...sparse import pooled_embedding_bags, split_sparse_features
from ._build import TensorRef, attr_ref, fuse_tensors, module_ref
from ._context import RewriteContext, Rule
from ._nodes import arg, module_of, plain_module

__all__ = ["EmbeddingBagGroup", "embedding_bag_operands", "offsets_from_lengths"]

_MODES = ("sum", "mean", "max")

# offsets are recognized only through these (shape and prefix-sum) ops
_OFFSET_FUNCTIONS = (torch.cumsum, torch.cat, torch.zeros, torch.zeros_like, torch.ones_like, F.pad, torch.narrow,
                     torch.flatten, torch.sub, torch.add, operator.getitem, operator.sub, operator.add, operator.neg,
                     builtins.getattr)
_OFFSET_METHODS = ("cumsum", "new_zeros", "new_ones", "to", "long", "int", "type", "type_as", "contiguous", "view",
                   "reshape", "flatten", "narrow", "sub", "add", "neg", "__getitem__")
_OFFSET_EXTERNAL = ("asynchronous_complete_cumsum", "asynchronous_exclusive_cumsum")  # fbgemm's prefix sums
_MAX_OFFSET_NODES = 24
_PROBE_BATCHES = (1, 2, 3, 5, 8, 13)


def _split_piece(node) -> Optional[Tuple[fx.Node, int, int]]:
    """``(split node, feature, 0 for indices / 1 for lengths)`` if ``node`` is ``split[f][k]``."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and len(node.args) == 2):
        return None
    pair, which = node.args
    if type(which) is not int or which not in (0, 1) or not (
            isinstance(pair, fx.Node) and pair.op == "call_function" and pair.target is operator.getitem
            and len(pair.args) == 2):
        return None
    split, feature = pair.args
    if not (isinstance(split, fx.Node) and split.op == "call_function" and split.target is split_sparse_features):
        return None
    count = arg(split, 2, "num_features")
    if type(feature) is not int or type(count) is not int or not 0 <= feature < count:
        return None
    return split, feature, which


def _allowed_offset_op(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _OFFSET_METHODS
    if node.op != "call_function":
        return False
    if any(node.target is f for f in _OFFSET_FUNCTIONS):
        return True
    name = getattr(node.target, "__name__", "") or str(node.target)
    return name.split(".")[-1] in _OFFSET_EXTERNAL or name.split(".")[0] in _OFFSET_EXTERNAL


def offsets_from_lengths(offsets: fx.Node, lengths: Sequence[fx.Node],
                         include_last_offset: bool) -> Optional[List[fx.Node]]:
    """The nodes that compute ``offsets`` from ``lengths`` alone (in graph order), if they compute bag offsets.

    ``lengths``: the nodes that stand for the one lengths tensor (equal getitems of a split).

    Bag offsets of lengths ``l`` are ``[0, l0, l0+l1, ...]``: B numbers, or B + 1 with the
    total when ``include_last_offset``. The nodes must be ops of a fixed set (prefix sums,
    concatenation, slicing, zeros, casts) reading nothing but ``lengths`` and constants;
    then they are run on probe lengths of several batch sizes and must give exactly that.
    """
    lengths = set(lengths)
    if not isinstance(offsets, fx.Node) or offsets in lengths:
        return None
    found: Dict[fx.Node, None] = {}
    stack = [offsets]
    while stack:
        node = stack.pop()
        if node in lengths or node in found:
            continue
        if not _allowed_offset_op(node) or len(found) >= _MAX_OFFSET_NODES:
            return None
        found[node] = None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(offsets.graph.nodes)}
    nodes = sorted(found, key=order.__getitem__)
    # N features usually compute their offsets with the same code: probe each shape of code once
    key = (_code_key(nodes, lengths), include_last_offset)
    verdict = _PROBED.get(key)
    if verdict is None:
        verdict = _probe(nodes, offsets, lengths, include_last_offset)
        if len(_PROBED) < 4096:
            _PROBED[key] = verdict
    return nodes if verdict else None


_PROBED: Dict[Tuple[str, bool], bool] = {}


def _code_key(nodes: Sequence[fx.Node], lengths) -> str:
    """The code of ``nodes`` with node references as positions (``L`` for the lengths), as text."""
    position = {n: i for i, n in enumerate(nodes)}

    def ref(n):
        return "L" if n in lengths else f"#{position[n]}"

    return repr([(n.op, n.target, fx.node.map_arg(n.args, ref), fx.node.map_arg(n.kwargs, ref)) for n in nodes])


def _probe(nodes: Sequence[fx.Node], offsets: fx.Node, lengths, include_last_offset: bool) -> bool:
    graph = fx.Graph()
    placeholder = graph.placeholder("lengths")
    env = {n: placeholder for n in lengths}
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[offsets])
    fn = fx.GraphModule(nn.Module(), graph)
    generator = torch.Generator().manual_seed(0)  # the rule must not move the global random state
    for dtype in (torch.int64, torch.int32):
        for batch in _PROBE_BATCHES:
            probe = torch.randint(0, 5, (batch,), generator=generator, dtype=dtype)
            if batch > 2:
                probe[batch // 2] = 0  # empty bags in the middle
            running = torch.cumsum(probe.long(), 0)
            expected = torch.cat([running.new_zeros(1), running if include_last_offset else running[:-1]])
            try:
                got = fn(probe)
            except Exception:  # an op that cannot run on the probe (a device move, a shape it needs): not offsets
                return False
            if not isinstance(got, torch.Tensor) or got.dim() != 1 or got.is_floating_point() or \
                    got.dtype == torch.bool or not torch.equal(got.long(), expected):
                return False
    return True


def embedding_bag_operands(ctx: RewriteContext, node: fx.Node):
    """``(split, feature, weight, mode, offset nodes)`` of an embedding bag this rule fuses, else None."""
    if node.op == "call_module":
        module = module_of(ctx, node)
        if module is None or not plain_module(module, nn.EmbeddingBag):
            return None
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse or module.padding_idx is not None:
            return None
        if len(node.args) > 3 or set(node.kwargs) - {"input", "offsets", "per_sample_weights"}:
            return None
        x, offsets = arg(node, 0, "input"), arg(node, 1, "offsets")
        if arg(node, 2, "per_sample_weights") is not None:
            return None
        weight = module_ref(ctx, node, "weight")
        mode, include_last = module.mode, module.include_last_offset
    elif node.op == "call_function" and node.target is F.embedding_bag:
        if len(node.args) > 3 or set(node.kwargs) - {"input", "weight", "offsets", "mode", "include_last_offset",
                                                     "max_norm", "scale_grad_by_freq", "sparse",
                                                     "per_sample_weights", "padding_idx", "norm_type"}:
            return None  # max_norm and the rest given positionally: not read here
        x, offsets = arg(node, 0, "input"), arg(node, 2, "offsets")
        weight = attr_ref(ctx, arg(node, 1, "weight"))
        kw = node.kwargs
        if kw.get("max_norm") is not None or kw.get("scale_grad_by_freq", False) or kw.get("sparse", False) or \
                kw.get("per_sample_weights") is not None or kw.get("padding_idx") is not None:
            return None
        mode, include_last = kw.get("mode", "mean"), kw.get("include_last_offset", False)
        if type(include_last) is not bool:
            return None
    else:
        return None
    if weight is None or weight.value.dim() != 2 or mode not in _MODES:
        return None
    piece = _split_piece(x)
    if piece is None or piece[2] != 0:
        return None
    split, feature, _ = piece
    lengths = [u for u in x.args[0].users if u.target is operator.getitem and len(u.args) == 2 and u.args[1] == 1]
    offset_nodes = offsets_from_lengths(offsets, lengths, include_last)
    if offset_nodes is None:
        return None
    return split, feature, weight, mode, offset_nodes


class EmbeddingBagGroup(Rule):
    name = "embedding_bags"
    description = "embedding bags over the pieces of a sparse-feature split -> one lookup on the combined input"
    needs_independence = False  # members read pieces of one split and nothing a member computes

    operands = staticmethod(embedding_bag_operands)

    def group_of(self, ctx: RewriteContext, split, feature, weight: TensorRef, mode, offset_nodes) -> Hashable:
        w = weight.value
        return split, mode, w.shape[1], w.dtype, w.device, w.requires_grad

    def rewrite(self, ctx: RewriteContext, key: Hashable, members: List[fx.Node]) -> bool:
        split, mode = key[0], key[1]
        chosen, operands, seen = [], [], set()
        for m in members:
            ops = embedding_bag_operands(ctx, m)
            if ops is not None and ops[1] not in seen:
                seen.add(ops[1])
                chosen.append(m)
                operands.append(ops)
        if len(chosen) < ctx.min_group_size:
            return False
        count = arg(split, 2, "num_features")
        tables: Dict[str, int] = {}
        refs: List[TensorRef] = []
        rows = [-1] * count
        total = 0
        for _, feature, weight, _, _ in operands:
            if weight.target not in tables:
                tables[weight.target] = total
                refs.append(weight)
                total += weight.value.shape[0]
            rows[feature] = tables[weight.target]
        every_feature = min(rows) >= 0
        with ctx.graph.inserting_before(chosen[0]):
            table = fuse_tensors(ctx, "embedding_bag_weight", refs, "cat", 0)
            row_offsets = _constant(ctx, "hfused_embedding_bag_rows", rows, refs[0].value.device)
            pooled = ctx.call(pooled_embedding_bags, split, table, row_offsets, mode, every_feature)
            parts = ctx.node("call_method", "unbind", (pooled, 0), num_pieces=count)
            outs = [ctx.call(operator.getitem, parts, ops[1]) for ops in operands]
        width = refs[0].value.shape[1]
        ctx.record(self.name, chosen, pooled,
                   f"{len(chosen)} x embedding_bag({mode}, {width} wide) on features of '{split.name}' "
                   f"-> 1 embedding_bag over {total} rows of {len(refs)} table(s)")
        for m, out, ops in zip(chosen, outs, operands):
            ctx.replace(m, out)
            # the offsets were computed for this member only: drop them and the pieces they read, so the
            # split is never asked for its per-feature pairs (ctx.erase keeps what is still used)
            for node in reversed(ops[4]):
                _erase_if_unused(ctx, node)
        for node in list(split.users):
            if node.target is operator.getitem:
                for piece in list(node.users):
                    _erase_if_unused(ctx, piece)
                _erase_if_unused(ctx, node)
        return True


def _erase_if_unused(ctx: RewriteContext, node: fx.Node) -> None:
    if not getattr(node, "_erased", False) and not node.users:  # erasing a member may have taken it already
        ctx.erase(node)


def _constant(ctx: RewriteContext, hint: str, values: List[int], device: torch.device) -> fx.Node:
    """A get_attr node for a new non-persistent buffer holding ``values`` (registered when the rewrite
    commits; not in the state dict, moved by ``.to()``). A meta model gets it on the CPU: it holds
    data, not weights to initialize."""
    place = torch.device("cpu") if device.type == "meta" else device
    return ctx.new_buffer(hint, torch.tensor(values, dtype=torch.int64, device=place))

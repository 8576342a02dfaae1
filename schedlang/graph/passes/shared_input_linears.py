"""Linears that read the same tensor become one GEMM on their weights concatenated at run time.

An attention block projects its input three times (q, k, v) and a gated MLP twice (gate, up). With
grouped-query attention the key and value projections are narrow (LLaMA-1.1B: 2048 -> 256): a GEMM
that thin leaves most of the GPU idle, and the three GEMMs of the backward for the input's gradient
are summed afterwards. One GEMM over the concatenated weights does the work of all of them::

    q = linear(x, wq); k = linear(x, wk); v = linear(x, wv)
    # becomes
    qkv = linear(x, cat([wq, wk, wv]))
    q, k, v = qkv.narrow(-1, 0, out_q), qkv.narrow(-1, out_q, out_k), qkv.narrow(-1, out_q + out_k, out_v)

The parameters stay as they are (the concatenation is a copy made on every call, a few MB per layer,
and autograd splits its gradient back onto each weight), so checkpoints, optimizers, sharding and
``Verify`` see the model's own parameters. Each output element is the same dot product over the
same inputs; only the GEMM kernel that computes it may change.

:func:`fuse_shared_input_linears` rewrites an FX graph in place (the Torch-IR graph that
``torch.compile`` hands to Inductor before autograd, or a ``symbolic_trace``); :class:`SharedInputLinearsPass`
runs it as Inductor's ``pre_grad_custom_pass``, which ``schedlang.models.compile_layers(...,
fuse_projections=True)`` gives the compiled layers. (The horizontal rule ``linear_same_input`` does the
like on a schedule's traced module, where it may create a new fused parameter; here the weights are graph
inputs, so they are concatenated per call.)

Candidates are calls of ``torch.nn.functional.linear`` (what ``nn.Linear`` and Dynamo's graphs call) whose
weight is a 2-D tensor; a group shares the input node, the weight's dtype, device and input width, and
whether there is a bias. Shapes come from the nodes' recorded example values (Dynamo records them; for
a ``symbolic_trace``, run ``ShapeProp``): a node without one is left alone, and so is a group with a
weight or bias computed after its first linear.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx

from ._inductor_pass import InductorPass

__all__ = ["fuse_shared_input_linears", "SharedInputLinearsPass"]

_LINEARS = (F.linear, torch._C._nn.linear)
COUNTER = "shared_input_linears"


def _meta(node) -> Optional[Tuple[torch.Size, torch.dtype, Optional[torch.device]]]:
    """(shape, dtype, device) of the tensor a graph node stands for, where the graph recorded it: an example
    or fake tensor (Dynamo, ``make_fx``), or ShapeProp's ``tensor_meta`` (which has no device)."""
    if not isinstance(node, fx.Node):
        return None
    for key in ("example_value", "val"):
        value = node.meta.get(key)
        if isinstance(value, torch.Tensor):
            return value.shape, value.dtype, value.device
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape") and hasattr(meta, "dtype"):
        return torch.Size(meta.shape), meta.dtype, None
    return None


def _operands(node: fx.Node) -> Optional[Tuple[fx.Node, fx.Node, Optional[fx.Node]]]:
    """(input, weight, bias) of a linear call, else None."""
    if node.op != "call_function" or node.target not in _LINEARS:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x = node.kwargs.get("input", args[0])
    weight = node.kwargs.get("weight", args[1])
    bias = node.kwargs.get("bias", args[2])
    if not isinstance(x, fx.Node) or not isinstance(weight, fx.Node):
        return None
    if bias is not None and not isinstance(bias, fx.Node):
        return None
    return x, weight, bias


def _key(x: fx.Node, weight: fx.Node, bias: Optional[fx.Node]) -> Optional[Hashable]:
    w = _meta(weight)
    if w is None or len(w[0]) != 2:
        return None
    if bias is not None:
        b = _meta(bias)
        if b is None or len(b[0]) != 1 or b[1] != w[1]:
            return None
    shape, dtype, device = w
    return (x, dtype, device, shape[1], bias is not None)


def fuse_shared_input_linears(graph: fx.Graph) -> int:
    """Rewrite each group of two or more linears on one input into one linear on concatenated weights and a
    narrow view per linear (see the module docstring); returns how many groups were fused."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups: Dict[Hashable, List[fx.Node]] = {}
    for node in graph.nodes:
        operands = _operands(node)
        key = _key(*operands) if operands is not None else None
        if key is not None:
            groups.setdefault(key, []).append(node)
    fused = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        first = members[0]
        operands = [_operands(m) for m in members]
        tensors = [t for _, w, b in operands for t in (w, b) if t is not None]
        late = [t for t in tensors if order[t] > order[first]]
        if any(t.op != "get_attr" for t in late):
            continue  # a weight computed after the first linear: nothing to concatenate it with yet
        for t in late:  # a get_attr reads a parameter and depends on nothing: it may come earlier
            first.prepend(t)
        x = operands[0][0]
        sizes = [int(_meta(w)[0][0]) for _, w, _ in operands]
        with graph.inserting_before(first):
            weight = graph.call_function(torch.cat, ([w for _, w, _ in operands], 0))
            bias = (graph.call_function(torch.cat, ([b for _, _, b in operands], 0))
                    if operands[0][2] is not None else None)
            y = graph.call_function(F.linear, (x, weight, bias))
            # one narrow view per member, not a split: autograd lets a user modify a narrow view in place,
            # but not one of the views a split returns together
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            outputs = [graph.call_function(torch.narrow, (y, -1, start, size)) for start, size in zip(starts, sizes)]
        for member, out in zip(members, outputs):
            member.replace_all_uses_with(out)
            graph.erase_node(member)
        fused += 1
    if fused:
        from torch._dynamo.utils import counters

        counters["schedlang"][COUNTER] += fused
    return fused


class SharedInputLinearsPass(InductorPass):
    """:func:`fuse_shared_input_linears` as an Inductor pre-grad pass, e.g.
    ``torch.compile(fn, options={"pre_grad_custom_pass": SharedInputLinearsPass()})`` (see
    :class:`~schedlang.graph.passes._inductor_pass.InductorPass` for its cache key and equality)."""

    NAME = "shared_input_linears"
    VERSION = 1

    def __call__(self, graph: fx.Graph) -> None:
        fuse_shared_input_linears(graph)

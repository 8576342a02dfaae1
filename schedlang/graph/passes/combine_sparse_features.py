"""Graph rewrite: a traced model's 2N sparse-feature inputs become one (indices, lengths) pair.

Before (N features, each an ``(indices, lengths)`` pair of inputs)::

    def forward(self, dense, a_idx, a_len, b_idx, b_len): ...

After::

    def forward(self, dense, sparse_indices, sparse_lengths):
        split = schedlang.sparse.split_sparse_features(sparse_indices, sparse_lengths, 2)
        a_idx = split[0][0]; a_len = split[0][1]; b_idx = split[1][0]; b_len = split[1][1]
        ...

The split is lazy (:class:`schedlang.sparse.SparseFeatureSplit`): it costs nothing until
a piece is read, and reading one makes all N pairs after one device-to-host copy of the N
per-feature totals. ``horizontal_fuse``'s ``embedding_bags`` rule replaces N embedding
bags over the pieces with one lookup on the combined pair, after which no piece is read
and nothing waits for the device.

The combined inputs take the place of the first feature input; the other inputs keep
their order. Feed the model with :func:`schedlang.sparse.combine_sparse_features` over
the features in the order given here.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Dict, List, Mapping, Sequence, Tuple

import torch
from torch import fx

from ...sparse import combine_sparse_features, split_sparse_features

__all__ = ["SparseFeatureLayout", "combine_sparse_inputs"]


@dataclass(frozen=True)
class SparseFeatureLayout:
    """How a rewritten model wants its sparse features: which inputs, in which order."""

    features: Tuple[Tuple[str, str], ...]
    indices_name: str
    lengths_name: str

    def combine(self, inputs: Mapping[str, torch.Tensor], pin_memory: bool = False):
        """``(indices, lengths)`` for the model from the original inputs by name.

        Example::

            indices, lengths = layout.combine({"a_idx": ..., "a_len": ..., "b_idx": ..., "b_len": ...})
        """
        return combine_sparse_features([(inputs[i], inputs[l]) for i, l in self.features], pin_memory=pin_memory)

    def __str__(self) -> str:
        shown = ", ".join(f"({i}, {l})" for i, l in self.features[:4]) + (", ..." if len(self.features) > 4 else "")
        return (f"{len(self.features)} sparse features [{shown}] -> inputs ({self.indices_name}, "
                f"{self.lengths_name})")


def combine_sparse_inputs(gm: fx.GraphModule, features: Sequence[Tuple[str, str]],
                          names: Tuple[str, str] = ("sparse_indices", "sparse_lengths")) -> SparseFeatureLayout:
    """Rewrite ``gm`` to take the features combined; the arguments must have been checked.

    The rewrite is done on a copy of the graph, installed only when complete.
    """
    graph = copy.deepcopy(gm.graph)
    placeholders: Dict[str, fx.Node] = {n.target: n for n in graph.nodes if n.op == "placeholder"}
    feature_nodes: List[Tuple[fx.Node, fx.Node]] = [(placeholders[i], placeholders[l]) for i, l in features]
    removed = {n for pair in feature_nodes for n in pair}
    first = next(n for n in graph.nodes if n in removed)
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_before(first):
        indices = graph.placeholder(names[0])
        lengths = graph.placeholder(names[1])
    with graph.inserting_after(last_placeholder):
        split = graph.call_function(split_sparse_features, (indices, lengths, len(features)))
    anchor = split
    for k, (idx_node, len_node) in enumerate(feature_nodes):
        with graph.inserting_after(anchor):
            pair = graph.call_function(operator.getitem, (split, k))
        with graph.inserting_after(pair):
            new_idx = graph.call_function(operator.getitem, (pair, 0))
        with graph.inserting_after(new_idx):
            new_len = graph.call_function(operator.getitem, (pair, 1))
        anchor = new_len
        idx_node.replace_all_uses_with(new_idx)
        len_node.replace_all_uses_with(new_len)
    for node in removed:
        graph.erase_node(node)
    graph.lint()
    gm.graph = graph
    gm.recompile()
    return SparseFeatureLayout(tuple((i, l) for i, l in features), names[0], names[1])

"""``combine_sparse_features(features, names=...)``: a traced model takes its sparse features combined.

``features`` lists the model's sparse-feature inputs as ``(indices_input, lengths_input)``
name pairs. The traced forward then takes one ``(indices, lengths)`` pair in their place
and splits it on the device (:func:`schedlang.sparse.split_sparse_features`), so the
input pipeline makes 2 host-to-device copies per batch instead of 2N. The split waits
for the device (one copy of the N per-feature totals to the host) only if a
per-feature tensor is read; ``horizontal_fuse()`` afterwards turns N embedding bags over
the features into one lookup on the combined pair (rule ``embedding_bags``), which reads
none. Returns the
:class:`~schedlang.graph.passes.combine_sparse_features.SparseFeatureLayout` whose
``combine`` builds the pair from a batch.

Example::

    sch.trace()
    layout = sch.combine_sparse_features([("user_ids", "user_lengths"), ("item_ids", "item_lengths")])
    sch.horizontal_fuse()    # the features' EmbeddingBags -> one lookup
    indices, lengths = layout.combine(batch, pin_memory=True)
    out = model(dense, indices.cuda(non_blocking=True), lengths.cuda(non_blocking=True))
"""

from __future__ import annotations

from typing import Sequence

from ..errors import ScheduleKeyError, ScheduleTypeError, ScheduleValueError
from .base import Param, Primitive, register_primitive
from .horizontal_fuse import require_traced

__all__ = ["CombineSparseFeatures"]


@register_primitive
class CombineSparseFeatures(Primitive):
    """Make the traced forward take its sparse inputs, given as (indices_input, lengths_input)
    name pairs, as one combined (indices, lengths) pair split on the device; returns the layout.

    Example::

        layout = sch.combine_sparse_features([("user_ids", "user_lengths"), ("item_ids", "item_lengths")])
        indices, lengths = layout.combine(batch, pin_memory=True)
    """

    name = "combine_sparse_features"
    params = (
        Param("features", Sequence[Sequence[str]], doc="(indices_input, lengths_input) name pairs of the forward",
              expects="a non-empty list of (indices_input, lengths_input) name pairs"),
        Param("names", Sequence[str], ("sparse_indices", "sparse_lengths"),
              "names of the two combined inputs", expects="two different identifiers"),
    )

    @classmethod
    def validate(cls, sch, features, names):
        where = sch.path or "<root>"
        gm = require_traced(sch, "combine_sparse_features")
        inputs = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        shown = ", ".join(inputs) or "none"
        if isinstance(features, (str, bytes)) or not isinstance(features, (list, tuple)) or not features:
            raise ScheduleTypeError(f"{where}: combine_sparse_features expects a non-empty list of "
                                    f"(indices_input, lengths_input) name pairs, got {features!r}; inputs are {shown}")
        pairs = []
        seen = set()
        for k, pair in enumerate(features):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(isinstance(p, str) for p in pair):
                raise ScheduleTypeError(f"{where}: sparse feature {k} must be a pair of input names "
                                        f"(indices, lengths), got {pair!r}")
            for name in pair:
                if name not in inputs:
                    raise ScheduleKeyError(f"{where}: sparse feature {k} names '{name}', which is not an input of the "
                                           f"traced forward; inputs are {shown}")
                if name in seen:
                    raise ScheduleValueError(f"{where}: input '{name}' appears twice in the sparse features; "
                                             "each input must appear once")
                seen.add(name)
            pairs.append([pair[0], pair[1]])
        if not isinstance(names, (list, tuple)) or len(names) != 2 or not all(
                isinstance(n, str) and n.isidentifier() for n in names) or names[0] == names[1]:
            raise ScheduleValueError(f"{where}: names must be two different identifiers for the combined inputs, "
                                     f"got {names!r}")
        for name in names:
            if name in inputs:
                raise ScheduleValueError(f"{where}: combined input name '{name}' is already an input of the traced "
                                         f"forward; choose another with names=(...)")
        return {"features": pairs, "names": [names[0], names[1]]}

    @classmethod
    def apply(cls, sch, features, names):
        from ..graph.passes.combine_sparse_features import combine_sparse_inputs

        layout = combine_sparse_inputs(sch.mod, [tuple(p) for p in features], tuple(names))
        sch.metadata["sparse_features"] = layout
        return layout

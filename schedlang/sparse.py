"""Sparse features as one pair of tensors: fewer host-to-device copies.

A sparse feature of a batch of B samples is two 1-D integer tensors: ``indices`` (every
sample's ids, back to back) and ``lengths`` (B counts, how many ids each sample has).
A model with N features needs 2N host-to-device copies per batch, each a separate
launch; for N = 1000 that is milliseconds of launch overhead for kilobytes of data.

:func:`combine_sparse_features` (input side, on the host) concatenates all indices into
one tensor and all lengths into another, so two copies move the batch.
:func:`split_sparse_features` (model side, on the device) cuts them apart again, lazily:
it returns a :class:`SparseFeatureSplit`, a sequence of N ``(indices, lengths)`` pairs that
costs nothing to make (no device-to-host copy, no kernel). Reading one of its pairs makes
all N at once, which needs each feature's total length on the host: one device-to-host
copy of N numbers, which waits for the device. Consumers that can work on the combined
form read ``split.indices``, ``split.lengths`` (``(N, B)``) and ``split.offsets`` instead
and never wait: :func:`pooled_embedding_bags` looks up the bags of every feature in one
``embedding_bag`` call (the ``sparse_embedding_bag`` horizontal rule emits it in place of
N ``nn.EmbeddingBag`` modules fed by the pieces of a split).

The ``combine_sparse_features`` schedule primitive inserts the split into a traced model,
whose forward then takes the combined pair in place of the 2N tensors.

Example::

    feats = [(torch.tensor([106, 211, 7]), torch.tensor([2, 1])),
             (torch.tensor([52, 498, 616, 870, 1013]), torch.tensor([3, 2]))]
    indices, lengths = combine_sparse_features(feats)
    # indices = [106, 211, 7, 52, 498, 616, 870, 1013], lengths = [2, 1, 3, 2]
    split = split_sparse_features(indices.cuda(), lengths.cuda(), num_features=2)
    split.lengths            # (2, 2) view, no copy
    split.offsets            # [0, 2, 3, 6, 8] on the device: where each bag starts, and the end
    (a_idx, a_len), (b_idx, b_len) = split   # the per-feature views (one device-to-host copy)
"""

from __future__ import annotations

from collections import abc
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .errors import ScheduleTypeError, ScheduleValueError

__all__ = ["combine_sparse_features", "split_sparse_features", "SparseFeatureSplit", "pooled_embedding_bags"]


def combine_sparse_features(features: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                            pin_memory: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Concatenate N sparse features ``(indices, lengths)`` into one ``(indices, lengths)`` pair.

    Every feature must have the same batch size (``lengths`` of equal size), so that
    :func:`split_sparse_features` can recover them from ``num_features`` alone. With
    ``pin_memory=True`` the result is in page-locked memory, ready for an asynchronous
    ``.to("cuda", non_blocking=True)``.
    """
    if isinstance(features, (torch.Tensor, str)) or not isinstance(features, Sequence) or not features:
        raise ScheduleTypeError(f"combine_sparse_features: expects a non-empty list of (indices, lengths) pairs, "
                                f"got {_describe(features)}")
    if _uniform(features):  # the usual case, checked in bulk (the checks one by one cost more than the copy)
        indices = [pair[0] for pair in features]
        lengths = [pair[1] for pair in features]
    else:
        indices, lengths = _checked(features)
    return _cat(indices, pin_memory), _cat(lengths, pin_memory)


def _uniform(features) -> bool:
    """Whether every feature is a pair of 1-D integer tensors, all indices of one kind, all lengths alike."""
    if not all(type(pair) in (tuple, list) and len(pair) == 2 for pair in features):
        return False
    index_kinds = {(type(p[0]), p[0].dtype, p[0].device, p[0].dim()) if isinstance(p[0], torch.Tensor) else None
                   for p in features}
    length_kinds = {(type(p[1]), p[1].dtype, p[1].device, p[1].shape) if isinstance(p[1], torch.Tensor) else None
                    for p in features}
    if len(index_kinds) != 1 or len(length_kinds) != 1 or None in index_kinds or None in length_kinds:
        return False
    (_, index_dtype, _, index_dim), = index_kinds
    (_, length_dtype, _, length_shape), = length_kinds
    return index_dim == 1 and len(length_shape) == 1 and all(
        not (d.is_floating_point or d.is_complex or d == torch.bool) for d in (index_dtype, length_dtype))


def _checked(features) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The indices and lengths of ``features`` after checking each feature; a clear error for the first bad one."""
    batch = None
    for i, pair in enumerate(features):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(isinstance(t, torch.Tensor) for t in pair):
            raise ScheduleTypeError(f"combine_sparse_features: feature {i} must be a pair (indices, lengths) of "
                                    f"tensors, got {_describe(pair)}")
        for what, t in zip(("indices", "lengths"), pair):
            if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ScheduleValueError(f"combine_sparse_features: feature {i} {what} must be a 1-D integer tensor, "
                                         f"got shape {tuple(t.shape)} of {t.dtype}")
        if batch is None:
            batch = pair[1].numel()
        elif pair[1].numel() != batch:
            raise ScheduleValueError(f"combine_sparse_features: feature {i} has {pair[1].numel()} lengths but feature 0 "
                                     f"has {batch}; every feature needs one length per sample of the batch")
    indices = [pair[0] for pair in features]
    lengths = [pair[1] for pair in features]
    for what, parts in (("indices", indices), ("lengths", lengths)):
        kinds = {(t.dtype, t.device) for t in parts}
        if len(kinds) > 1:
            shown = ", ".join(f"{d} on {dev}" for d, dev in sorted(kinds, key=str))
            raise ScheduleValueError(f"combine_sparse_features: the {what} tensors mix dtypes/devices ({shown}); "
                                     "they must share one; convert them first")
    return indices, lengths


def _cat(parts: List[torch.Tensor], pin_memory: bool) -> torch.Tensor:
    if not pin_memory:
        return torch.cat(parts)
    out = torch.empty(sum(t.numel() for t in parts), dtype=parts[0].dtype, pin_memory=True)
    return torch.cat(parts, out=out)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_integer_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def split_sparse_features(indices: torch.Tensor, lengths: torch.Tensor, num_features: int) -> "SparseFeatureSplit":
    """Inverse of :func:`combine_sparse_features`: ``num_features`` pairs of views into the inputs.

    Works on any device and returns at once: the result is a :class:`SparseFeatureSplit`
    (a sequence of ``(indices_i, lengths_i)`` pairs) whose pairs are made on first use.
    Making them needs each feature's total length on the host (``torch.split`` takes sizes
    from the host): one device-to-host copy of N numbers, which waits for the device.
    Nothing is copied while only the combined form (``indices``, ``lengths``, ``offsets``)
    is read.

    Example::

        split = split_sparse_features(indices, lengths, 3)
        (a_idx, a_len), (b_idx, b_len), (c_idx, c_len) = split
    """
    if type(num_features) is not int or num_features < 1:
        raise ScheduleValueError(f"split_sparse_features: num_features must be an int >= 1, got {num_features!r}")
    for what, t in (("indices", indices), ("lengths", lengths)):
        if not _is_integer_tensor(t) or t.dim() != 1:
            got = f"shape {tuple(t.shape)} of {t.dtype}" if isinstance(t, torch.Tensor) else _describe(t)
            raise ScheduleValueError(f"split_sparse_features: {what} must be a 1-D integer tensor, got {got}")
    if indices.device != lengths.device:
        raise ScheduleValueError(f"split_sparse_features: indices are on {indices.device} but lengths on "
                                 f"{lengths.device}; both must be on one device")
    if lengths.numel() % num_features:
        raise ScheduleValueError(f"split_sparse_features: {lengths.numel()} lengths cannot be {num_features} features "
                                 f"of one batch size; the number of lengths must be divisible by {num_features}")
    return SparseFeatureSplit(indices, lengths.view(num_features, lengths.numel() // num_features))


class SparseFeatureSplit(abc.Sequence):
    """N sparse features cut from one combined ``(indices, lengths)`` pair, made lazily.

    As a sequence it holds N ``(indices_i, lengths_i)`` pairs of views (index, iterate,
    unpack it like the tuple :func:`split_sparse_features` used to return). The first such
    access makes all N pairs at once and waits for the device (one copy of the N totals to
    the host); later accesses reuse them. The combined form is there without waiting:

    * ``indices``: the flat indices of all features, feature after feature;
    * ``lengths``: an ``(N, B)`` view of the lengths, row ``f`` for feature ``f``;
    * ``offsets``: ``(N * B + 1,)`` on the device, where each bag (sample of a feature)
      starts in ``indices``, then the total: ``embedding_bag``'s offsets with
      ``include_last_offset=True``; ``offsets[:-1]`` without it;
    * ``feature_offsets``: ``(N + 1,)``, where each feature starts in ``indices``, then the total;
    * ``feature_lengths``: ``(N,)``, how many indices each feature has;
    * ``num_features`` (N) and ``batch_size`` (B).

    The device tensors are computed on first use (one kernel or two each) and kept.

    Example::

        split = split_sparse_features(indices, lengths, 3)
        pooled = F.embedding_bag(split.indices, table, split.offsets, include_last_offset=True)  # (3 * B, D)
        a_idx, a_len = split[0]     # makes the three pairs (waits for the device once)
    """

    __slots__ = ("indices", "lengths", "_offsets", "_feature_lengths", "_pieces")

    def __init__(self, indices: torch.Tensor, lengths: torch.Tensor):
        self.indices = indices
        self.lengths = lengths
        self._offsets: Optional[torch.Tensor] = None
        self._feature_lengths: Optional[torch.Tensor] = None
        self._pieces: Optional[Tuple[Tuple[torch.Tensor, torch.Tensor], ...]] = None

    @property
    def num_features(self) -> int:
        return self.lengths.shape[0]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[1]

    @property
    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            # zero, then the running sum of every bag's length, in the indices' dtype (embedding_bag wants them alike)
            flat = self.lengths.reshape(-1)
            out = torch.empty(flat.numel() + 1, dtype=self.indices.dtype, device=self.indices.device)
            out[:1].zero_()
            torch.cumsum(flat, 0, dtype=out.dtype, out=out[1:])
            self._offsets = out
        return self._offsets

    @property
    def feature_offsets(self) -> torch.Tensor:
        if self.batch_size == 0:
            return self.offsets.expand(self.num_features + 1)
        return self.offsets[::self.batch_size]  # every B-th bag boundary is a feature boundary

    @property
    def feature_lengths(self) -> torch.Tensor:
        if self._feature_lengths is None:
            self._feature_lengths = self.lengths.sum(1)
        return self._feature_lengths

    @property
    def materialized(self) -> bool:
        """Whether the per-feature pairs have been made (the device was waited for)."""
        return self._pieces is not None

    def pieces(self) -> Tuple[Tuple[torch.Tensor, torch.Tensor], ...]:
        """The N ``(indices_i, lengths_i)`` pairs as a tuple (made on the first call)."""
        if self._pieces is None:
            counts = self.feature_lengths.tolist()  # the one device-to-host copy
            total = sum(counts)
            if total != self.indices.numel() or min(counts) < 0:
                raise ScheduleValueError(
                    f"split_sparse_features: the lengths of the {self.num_features} features add up to {total} "
                    f"indices (per feature: {_short(counts)}), but indices has {self.indices.numel()}; the lengths "
                    "must count the indices exactly, feature after feature")
            # split and unbind make the 2N views in C++; indexing them one by one in Python costs more
            self._pieces = tuple(zip(torch.split(self.indices, counts), self.lengths.unbind(0)))
        return self._pieces

    def __len__(self) -> int:
        return self.num_features

    def __getitem__(self, item: Union[int, slice]):
        return self.pieces()[item]

    def __iter__(self):
        return iter(self.pieces())

    def __repr__(self) -> str:
        state = "pairs made" if self._pieces is not None else "pairs not made yet"
        return (f"SparseFeatureSplit({self.num_features} features, batch {self.batch_size}, "
                f"{self.indices.numel()} indices of {self.indices.dtype} on {self.indices.device}, {state})")


def _short(values: List[int], limit: int = 6) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return f"[{shown}, ...]" if len(values) > limit else f"[{shown}]"


def pooled_embedding_bags(split: SparseFeatureSplit, weight: torch.Tensor, row_offsets: torch.Tensor,
                          mode: str = "sum", every_feature: bool = True) -> torch.Tensor:
    """Every feature's bags in one ``embedding_bag`` call: an ``(N, B, D)`` tensor, without waiting.

    ``weight`` holds the tables of the features one after another (rows of feature ``f``'s
    table from ``row_offsets[f]``); ``row_offsets`` is an ``(N,)`` integer tensor on the
    device. Feature ``f``'s index ``i`` reads row ``row_offsets[f] + i``. With
    ``every_feature=False`` a negative row offset marks a feature without a table: its
    indices read row 0 and its ``(B, D)`` slice of the result is to be ignored. Ids are not checked against the size of their
    own table: one past the end reads the next table's first row where a separate
    ``embedding_bag`` would fail.

    Cost: a sum over the ``(N, B)`` lengths and a cumsum (once per split), one
    ``repeat_interleave`` and one add over the indices (and a ``where`` unless
    ``every_feature``), and the lookup itself.

    Example::

        weight = torch.cat([bag_a.weight, bag_b.weight])
        rows = torch.tensor([0, bag_a.num_embeddings], device=weight.device)
        a, b = pooled_embedding_bags(split, weight, rows, "sum").unbind(0)   # each (B, D)
    """
    if not isinstance(split, SparseFeatureSplit):
        raise ScheduleTypeError(f"pooled_embedding_bags: expects the SparseFeatureSplit of split_sparse_features, "
                                f"got {_describe(split)}")
    if mode not in ("sum", "mean", "max"):
        raise ScheduleValueError(f"pooled_embedding_bags: mode must be 'sum', 'mean' or 'max', got {mode!r}")
    if not _is_integer_tensor(row_offsets) or tuple(row_offsets.shape) != (split.num_features,):
        got = f"shape {tuple(row_offsets.shape)} of {row_offsets.dtype}" if isinstance(row_offsets, torch.Tensor) \
            else _describe(row_offsets)
        raise ScheduleValueError(f"pooled_embedding_bags: row_offsets must be an integer tensor of shape "
                                 f"({split.num_features},) (one per feature), got {got}")
    indices = split.indices
    # each index's table offset; output_size (known on the host) keeps repeat_interleave from waiting for the device
    shift = torch.repeat_interleave(row_offsets, split.feature_lengths, output_size=indices.numel())
    rows = indices + shift
    if not every_feature:
        rows = torch.where(shift < 0, torch.zeros((), dtype=rows.dtype, device=rows.device), rows)
    pooled = F.embedding_bag(rows, weight, split.offsets, mode=mode, include_last_offset=True)
    return pooled.view(split.num_features, split.batch_size, weight.shape[1])

"""Sparse features as one pair of tensors: fewer host-to-device copies.

A sparse feature of a batch of B samples is two 1-D integer tensors: ``indices`` (every
sample's ids, back to back) and ``lengths`` (B counts, how many ids each sample has).
A model with N features needs 2N host-to-device copies per batch, each a separate
launch; for N = 1000 that is milliseconds of launch overhead for kilobytes of data.

:func:`combine_sparse_features` (input side, on the host) concatenates all indices into
one tensor and all lengths into another, so two copies move the batch.
:func:`split_sparse_features` (model side, on the device) cuts them apart again:
lengths as an ``(N, B)`` view, indices by each feature's total length. The
``combine_sparse_features`` schedule primitive inserts that split into a traced model,
whose forward then takes the combined pair in place of the 2N tensors.

Example::

    feats = [(torch.tensor([106, 211, 7]), torch.tensor([2, 1])),
             (torch.tensor([52, 498, 616, 870, 1013]), torch.tensor([3, 2]))]
    indices, lengths = combine_sparse_features(feats)
    # indices = [106, 211, 7, 52, 498, 616, 870, 1013], lengths = [2, 1, 3, 2]
    back = split_sparse_features(indices.cuda(), lengths.cuda(), num_features=2)
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .errors import ScheduleTypeError, ScheduleValueError

__all__ = ["combine_sparse_features", "split_sparse_features"]


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
    return _cat(indices, pin_memory), _cat(lengths, pin_memory)


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


def split_sparse_features(indices: torch.Tensor, lengths: torch.Tensor,
                          num_features: int) -> Tuple[Tuple[torch.Tensor, torch.Tensor], ...]:
    """Inverse of :func:`combine_sparse_features`: ``num_features`` pairs of views into the inputs.

    Works on any device. The lengths are an ``(N, B)`` view; the indices are split by
    each feature's total length, which costs one device-to-host copy of N numbers
    (``torch.split`` needs the sizes on the host).
    """
    if lengths.numel() % num_features:
        raise ScheduleValueError(f"split_sparse_features: {lengths.numel()} lengths cannot be {num_features} features "
                                 f"of one batch size; the number of lengths must be divisible by {num_features}")
    per_feature = lengths.view(num_features, -1)
    counts = per_feature.sum(1).tolist()
    # split and unbind make the 2N views in C++; indexing them one by one in Python costs more
    return tuple(zip(torch.split(indices, counts), per_feature.unbind(0)))

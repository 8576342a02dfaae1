"""Resharding an activation between layouts named by two letters per dimension pair.

``R`` is replicated, ``S`` sharded: for an activation ``(..., seq, hidden)``, ``RS`` is split
along the hidden (last) axis and ``SR`` along the sequence (second to last) axis.
``parse_reshard("RS->SR", group)`` returns the function for one change of layout. All are
differentiable (the gradient goes back to the source layout).

====================  ===========================================
scheme                what moves
====================  ===========================================
``RR->RS/SR``         nothing: each rank keeps its slice
``RS/SR->RR``         all-gather along the sharded axis
``RS->SR, SR->RS``    all-to-all (here: gather, then keep a slice)
====================  ===========================================

Example::

    sch["attn"].sync(mode="fwd_post", sync_op_or_fn=parse_reshard("RS->SR", sch.group))
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from ..distributed import collectives as _c
from ..errors import SyncError

__all__ = ["parse_reshard", "identity", "reshard_RR_to_RS", "reshard_RR_to_SR", "reshard_RS_to_RR",
           "reshard_RS_to_SR", "reshard_SR_to_RR", "reshard_SR_to_RS"]

_LAST, _SECOND_LAST = -1, -2


def identity(in_tensor: torch.Tensor) -> torch.Tensor:
    return in_tensor


def reshard_RR_to_RS(in_tensor: torch.Tensor, group=None) -> torch.Tensor:
    return _c.scatter_forward(in_tensor, in_tensor.dim() - 1, group)


def reshard_RR_to_SR(in_tensor: torch.Tensor, group=None) -> torch.Tensor:
    return _c.scatter_forward(in_tensor, in_tensor.dim() - 2, group)


def reshard_RS_to_RR(in_tensor: torch.Tensor, group=None) -> torch.Tensor:
    return _c.gather_forward(in_tensor, in_tensor.dim() - 1, group)


def reshard_SR_to_RR(in_tensor: torch.Tensor, group=None) -> torch.Tensor:
    return _c.gather_forward(in_tensor, in_tensor.dim() - 2, group)


def reshard_RS_to_SR(in_tensor: torch.Tensor, group=None) -> torch.Tensor:
    # an all-to-all moves (1/p - 1/p^2) of the tensor; gather + slice moves more but works on every
    # backend (gloo has no all-to-all) and its autograd is the two collectives' adjoints
    return reshard_RR_to_SR(reshard_RS_to_RR(in_tensor, group), group)


def reshard_SR_to_RS(in_tensor: torch.Tensor, group=None) -> torch.Tensor:
    return reshard_RR_to_RS(reshard_SR_to_RR(in_tensor, group), group)


_SCHEMES = {
    "RR->RR": None, "RS->RS": None, "SR->SR": None,
    "RR->RS": reshard_RR_to_RS, "RR->SR": reshard_RR_to_SR, "RS->RR": reshard_RS_to_RR,
    "RS->SR": reshard_RS_to_SR, "SR->RR": reshard_SR_to_RR, "SR->RS": reshard_SR_to_RS,
}


def parse_reshard(scheme: str, group=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function that reshards an activation as ``scheme`` (e.g. ``"RS->SR"``) says."""
    key = scheme.replace(" ", "") if isinstance(scheme, str) else scheme
    if key not in _SCHEMES:
        raise SyncError(f"parse_reshard: unknown scheme {scheme!r}: valid are {', '.join(_SCHEMES)}")
    fn = _SCHEMES[key]
    return identity if fn is None else partial(fn, group=group)

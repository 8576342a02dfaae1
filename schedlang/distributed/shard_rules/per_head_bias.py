"""Per-head biases an attention module gets from its caller (ALiBi): sliced to this rank's heads.

Some attention modules add to their scores a bias with one slice per head that the model computes
once and passes to every layer: BLOOM's and Falcon's ``alibi`` (``(batch * heads, 1, keys)``),
MPT's ``position_bias`` (``(heads, 1, keys)``). Once the heads are split over the ranks the
module computes ``heads / world`` heads, but the bias it receives still holds all of them, and
the scores and the bias no longer line up (a shape error, or in the worst case a broadcast that
adds the wrong heads' slopes).

The slopes of ALiBi depend on the total number of heads, so the bias cannot be rebuilt for the
local heads; it is cut instead. :func:`head_bias_arguments` finds such arguments from the
forward's signature (and, beside one or where the model's config says ALiBi, the attention mask, which a
model may have folded such a bias into: Falcon's is then ``(batch, heads, queries, keys)``), and
:class:`HeadBiasSlice` is the forward pre-hook the generic attention rule installs when it splits the heads: it takes this
rank's heads out of the argument, along the head axis, whatever layout the model uses:

* ``(heads, ...)``: the heads lead;
* ``(batch * heads, ...)``: batch-major, heads within;
* ``(batch, heads, ...)``: the heads second.
"""

from __future__ import annotations

import inspect
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ...errors import ShardError

__all__ = ["HEAD_BIAS_ARGUMENTS", "head_bias_arguments", "HeadBiasSlice", "install_head_bias_slices"]

#: names of forward arguments that hold a bias with one entry per attention head
HEAD_BIAS_ARGUMENTS = ("alibi", "position_bias", "alibi_bias", "attn_bias")
#: arguments that hold one entry per head only sometimes: a 4-D mask ``(batch, heads, queries, keys)`` into
#: which the model folded a per-head bias (Falcon with ALiBi); a mask broadcast over the heads passes as it is
HEAD_MASK_ARGUMENTS = ("attention_mask",)


def head_bias_arguments(klass: type, folds_alibi: bool = False) -> List[Tuple[str, int]]:
    """``(name, position)`` of the per-head bias arguments of ``klass.forward`` (position counts after ``self``).
    The mask counts beside a bias argument, or when ``folds_alibi`` (:func:`folds_alibi_into_mask`)."""
    try:
        parameters = list(inspect.signature(klass.forward).parameters.values())[1:]
    except (TypeError, ValueError):  # a forward without a signature takes no such argument by name
        return []
    with_mask = folds_alibi or any(p.name in HEAD_BIAS_ARGUMENTS for p in parameters)
    names = HEAD_BIAS_ARGUMENTS + (HEAD_MASK_ARGUMENTS if with_mask else ())
    return [(p.name, i) for i, p in enumerate(parameters)
            if p.name in names and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def folds_alibi_into_mask(module: nn.Module) -> bool:
    """Whether ``module``'s config says the model uses ALiBi, which reaches an attention that takes no bias
    argument only through its mask (transformers' Falcon from 5.25 on adds it to the mask before the layers)."""
    config = getattr(module, "config", None)
    return bool(getattr(config, "alibi", False) is True or getattr(config, "use_alibi", False) is True
                or getattr(config, "position_embedding_type", None) == "alibi")


def _slice_heads(bias: torch.Tensor, heads: int, rank: int, world: int, where: str, mask: bool = False) -> torch.Tensor:
    local = heads // world
    if mask:  # a mask holds heads only as the second of four axes; otherwise it is broadcast over them
        return bias.narrow(1, rank * local, local) if bias.dim() == 4 and bias.shape[1] == heads else bias
    if bias.dim() >= 1 and bias.shape[0] == heads:
        return bias.narrow(0, rank * local, local)
    if bias.dim() >= 2 and bias.shape[1] == heads:
        return bias.narrow(1, rank * local, local)
    if bias.dim() >= 1 and bias.shape[0] % heads == 0:
        batch = bias.shape[0] // heads
        split = bias.reshape(batch, heads, *bias.shape[1:]).narrow(1, rank * local, local)
        return split.reshape(batch * local, *bias.shape[1:])
    raise ShardError(f"{where}: a per-head bias of shape {tuple(bias.shape)} has no axis of {heads} heads (nor "
                     f"batch x {heads}); register a shard rule for the attention that slices it")


class HeadBiasSlice:
    """Forward pre-hook (``with_kwargs=True``): replaces the per-head bias argument ``name`` (at ``position``
    among the positional arguments) by this rank's heads of it."""

    def __init__(self, name: str, position: int, heads: int, rank: int, world: int):
        self.name, self.position = name, position
        self.heads, self.rank, self.world = heads, rank, world
        self.mask = name in HEAD_MASK_ARGUMENTS

    def __call__(self, module: nn.Module, args, kwargs):
        if self.name in kwargs:
            bias = kwargs[self.name]
            if isinstance(bias, torch.Tensor):
                kwargs = {**kwargs, self.name: _slice_heads(bias, self.heads, self.rank, self.world,
                                                            self._where(module), self.mask)}
            return args, kwargs
        if self.position < len(args) and isinstance(args[self.position], torch.Tensor):
            sliced = _slice_heads(args[self.position], self.heads, self.rank, self.world, self._where(module),
                                  self.mask)
            args = args[:self.position] + (sliced,) + args[self.position + 1:]
        return args, kwargs

    def _where(self, module: nn.Module) -> str:
        return f"{type(module).__name__}.forward argument '{self.name}'"

    def __repr__(self) -> str:
        return f"HeadBiasSlice({self.name!r}, heads {self.rank * self.heads // self.world}.." \
               f"{(self.rank + 1) * self.heads // self.world} of {self.heads})"


def installed(module: nn.Module) -> Dict[str, HeadBiasSlice]:
    return {h.name: h for h in module._forward_pre_hooks.values() if isinstance(h, HeadBiasSlice)}


def install_head_bias_slices(module: nn.Module, heads: int, rank: int, world: int) -> Optional[List[str]]:
    """Slice every per-head bias argument of ``module``'s forward to this rank's heads (once per argument);
    returns the names of the arguments sliced."""
    names = []
    present = installed(module)
    for name, position in head_bias_arguments(type(module), folds_alibi_into_mask(module)):
        if name not in present:
            module.register_forward_pre_hook(HeadBiasSlice(name, position, heads, rank, world), with_kwargs=True)
        names.append(name)
    return names

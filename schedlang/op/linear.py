"""Linear layers for schedules: a separate bias add, a sync point before the bias, and the
bias add fused with an activation or with dropout; and a fused q|k|v projection.

All derive from ``nn.Linear`` (same parameters, same ``state_dict``), so they replace a Linear
without touching its weights::

    new = LinearWithAct(old.in_features, old.out_features, act_fn="gelu")
    new.weight, new.bias = old.weight, old.bias
    sch["mlp.fc_in"].replace(new)
"""

from __future__ import annotations

from functools import partial
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.sync_ops import bias_after_inner_syncs, run_post_syncs
from ..errors import ScheduleTypeError, ScheduleValueError
from ..module_record import module_record
from .fused_bias import ACTIVATIONS, bias_act, bias_dropout

__all__ = ["FusedQKV", "LinearWithSeparateBias", "LinearWithSyncFunc", "LinearWithAct", "LinearWithDropout"]


class FusedQKV(nn.Module):
    """One Linear computing queries, keys and values, laid out head by head.

    Output row ``(h * head_size + d) * 3 + j`` is head ``h``, channel ``d`` of q (``j=0``), k (1)
    or v (2), so sharding ``fused_linear`` along axis 0 over ``world_size`` ranks gives each rank
    whole heads. ``forward(x)`` returns ``[q, k, v]``, each ``(..., num_heads / world_size, head_size)``.
    """

    def __init__(self, hidden_size: int, num_heads: int, world_size: int = 1) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ScheduleValueError(f"FusedQKV: hidden_size {hidden_size} is not a multiple of num_heads {num_heads}; "
                                     "hidden_size must be divisible by num_heads")
        if num_heads % world_size:
            raise ScheduleValueError(f"FusedQKV: {num_heads} heads do not split over world_size {world_size}: valid "
                                     f"world sizes divide {num_heads}")
        self.hidden_size, self.num_heads, self.world_size = hidden_size, num_heads, world_size
        self.head_size = hidden_size // num_heads
        self.fused_linear = nn.Linear(hidden_size, 3 * num_heads * self.head_size)

    def forward(self, hidden_states: torch.Tensor) -> List[torch.Tensor]:
        qkv = self.fused_linear(hidden_states)
        qkv = qkv.view(*qkv.shape[:-1], self.num_heads // self.world_size, self.head_size, 3)
        return [t.contiguous() for t in qkv.unbind(-1)]

    @staticmethod
    def fuse_weights(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_size: int) -> torch.Tensor:
        """Interleave separate q, k, v weights ``(H*D, in)`` (or biases ``(H*D,)``) into this layout."""
        stacked = torch.stack([q, k, v], dim=1)  # (H*D, 3, ...)
        return stacked.reshape(3 * q.shape[0], *q.shape[1:])


class LinearWithSeparateBias(nn.Linear):
    """``x @ W.T`` and then ``+ b`` as two operations, so the bias add can fuse with what follows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        return out if self.bias is None else out + self.bias


def _describe_fn(fn: Optional[Callable]) -> str:
    if fn is None:
        return "None"
    if isinstance(fn, partial):
        args = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in (fn.keywords or {}).items()]
        return f"partial({_describe_fn(fn.func)}, {', '.join(args)})"
    return getattr(fn, "__name__", repr(fn))


class LinearWithSyncFunc(nn.Linear):
    """A Linear that calls ``sync_fn`` on ``x @ W.T`` before adding the bias (a row-parallel
    Linear must all-reduce its partial sums before the bias, which is added once).

    Sharded row parallel by a schedule (``shard("weight", axis=1)`` and a ``fwd_post`` sync), it
    runs its forward-post syncs itself, at the same point: ``x @ W.T``, the syncs, then the bias
    (and, in the subclasses, the activation or dropout fused with it). Its record says so
    (``syncs_before_bias``), so no class change is needed.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 sync_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        super().__init__(in_features, out_features, bias, device, dtype)
        if sync_fn is not None and not callable(sync_fn):
            raise ScheduleTypeError(f"{type(self).__name__}: sync_fn must be callable, got {sync_fn!r}")
        self.sync_fn = sync_fn

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` through the schedule's forward-post syncs (row parallel), then ``sync_fn``."""
        out = F.linear(x, self.weight)
        if module_record(self).syncs_before_bias:
            out = run_post_syncs(self, out)
        return out if self.sync_fn is None else self.sync_fn(out)

    def _bias(self) -> Optional[torch.Tensor]:
        """The bias to add after :meth:`_matmul` (its gradient summed where the syncs split the output)."""
        if self.bias is None or not module_record(self).syncs_before_bias:
            return self.bias
        return bias_after_inner_syncs(self, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        bias = self._bias()
        return out if bias is None else out + bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sync_fn={_describe_fn(self.sync_fn)}"


def _require_bias(cls_name: str, bias: bool) -> None:
    if not bias:
        raise ScheduleValueError(f"op.linear: {cls_name} fuses the bias add and needs bias=True; use nn.Linear without a bias")


class LinearWithAct(LinearWithSyncFunc):
    """``act(x @ W.T + b)`` with the bias add and the activation fused (see
    :func:`schedlang.op.fused_bias.bias_act`). ``act_fn`` names an activation as HF configs do:
    ``gelu`` (exact), ``gelu_new`` / ``gelu_tanh`` / ``gelu_pytorch_tanh``, ``relu``, ``silu``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, act_fn: str = "gelu", device=None,
                 dtype=None, sync_fn=None):
        _require_bias(type(self).__name__, bias)
        if act_fn not in ACTIVATIONS:
            raise ScheduleValueError(f"LinearWithAct: unknown act_fn {act_fn!r}: valid are {', '.join(ACTIVATIONS)}")
        super().__init__(in_features, out_features, bias, device, dtype, sync_fn)
        self.act_fn = act_fn
        self.act = ACTIVATIONS[act_fn]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_act(self._matmul(x), self._bias(), self.act)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, act_fn={self.act_fn}"


class LinearWithDropout(LinearWithSyncFunc):
    """``dropout(x @ W.T + b, p)`` with the bias add fused into the dropout. ``use_torchscript``
    is accepted for compatibility and ignored (``torch.compile`` fuses the two).

    Row parallel, it computes ``dropout(all_reduce(x_local @ W_local.T) + b)``: the bias is added once,
    to the summed output, which every rank then holds whole; the dropout draws from the default
    random stream, so ranks seeded alike drop the same elements (the same mask the unsharded module
    draws under that seed). Do not ``fork_rng`` such a module: a per-rank stream would make the
    replicated output differ between ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, p: float = 0.5, inplace: bool = False,
                 device=None, dtype=None, sync_fn=None, use_torchscript: bool = False):
        _require_bias(type(self).__name__, bias)
        if not 0.0 <= p <= 1.0:
            raise ScheduleValueError(f"LinearWithDropout: dropout probability p must be in [0, 1], got {p}")
        super().__init__(in_features, out_features, bias, device, dtype, sync_fn)
        self.p, self.inplace, self.use_torchscript = p, inplace, use_torchscript

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_dropout(self._matmul(x), self._bias(), self.p, self.training, self.inplace)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, p={self.p}, inplace={self.inplace}"

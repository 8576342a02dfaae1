"""Context parallelism: the sequence of every input split over the mesh's ``cp`` ranks.

Each of ``N`` ranks holds ``L / N`` tokens of a sequence of ``L``. Causal attention makes late tokens
cost more than early ones, so the split is load-balanced: the sequence is cut into ``2N`` equal chunks
and rank ``r`` holds chunks ``r`` and ``2N - 1 - r`` (one early, one late), in that order. Everything but
attention is per token and runs on the local tokens unchanged; rotary embeddings see the global
positions (``position_ids`` follow the split).

Attention is the only exchange. :func:`context_parallel_attention` is registered in transformers'
``AttentionInterface`` as ``"schedlang_context_parallel"``; the ``context_parallel`` primitive points the
model's config at it. It all-gathers K and V over ``cp`` (the backward reduce-scatters their
gradients, so each rank gets the gradient of its own keys from every rank's queries), puts the keys
back in global order and computes each local query against all keys under a mask built from global
positions: causal, and a sliding window when the layer has one; GQA through SDPA's ``enable_gqa``.

Why not ``torch.distributed.tensor.experimental.context_parallel``: it rings K/V through SDPA's
flash / memory-efficient CUDA kernels and does not run on CPU or gloo. The all-gather here runs on
any backend and keeps the exchange to one collective per layer; its memory is one layer's full K/V.

The loss follows the split: :func:`context_parallel_loss` shifts the labels on the full sequence,
keeps this rank's tokens, and sums the token losses and the token count over ``cp``. Parameter
gradients are then averaged over ``cp`` like over data-parallel ranks (``build`` does it: FSDP / DDP
run on the flattened ``dp x cp`` mesh, or a gradient hook averages over ``cp`` alone), and each rank's
loss is scaled so that average is the single process's gradient.
"""

from __future__ import annotations

import inspect
import logging
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..errors import ScheduleValueError
from .collectives import gather_forward

__all__ = ["ATTENTION_NAME", "ContextParallelGroup", "chunk_order", "local_positions", "split_sequence",
           "gather_sequence", "check_sequence_length", "context_parallel_attention", "context_parallel_loss",
           "split_for_context_parallel", "average_gradients_over", "group_of", "SplitInputs"]

logger = logging.getLogger("schedlang.distributed.context_parallel")

#: the name the attention function is registered under in transformers' AttentionInterface
ATTENTION_NAME = "schedlang_context_parallel"


class ContextParallelGroup:
    """The ``cp`` ranks a model's sequence is split over: the process group, its size and this rank.

    Kept on the attention modules; a copy of the model (``copy.deepcopy``) shares it, as process
    groups cannot be copied."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"ContextParallelGroup(size={self.size}, rank={self.rank})"


def chunk_order(cp: int) -> list:
    """The chunks (of ``2 * cp``) each rank holds, rank by rank: ``[[0, 2cp-1], [1, 2cp-2], ...]``."""
    return [[r, 2 * cp - 1 - r] for r in range(cp)]


def check_sequence_length(length: int, cp: int, where: str) -> None:
    """Raise ScheduleValueError unless ``length`` cuts into ``2 * cp`` equal chunks."""
    if length % (2 * cp):
        lower = length - length % (2 * cp)
        raise ScheduleValueError(
            f"{where}: a sequence of {length} tokens does not split over cp={cp} ranks: the load-balanced split "
            f"cuts it into {2 * cp} equal chunks, so its length must be a multiple of {2 * cp} (e.g. {lower or 2 * cp}"
            f" or {lower + 2 * cp})")


def local_positions(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions (int64) of the tokens rank ``rank`` holds of a sequence of ``length``, in local order."""
    chunk = length // (2 * cp)
    first, second = chunk_order(cp)[rank]
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def _global_order(length: int, cp: int, device=None) -> torch.Tensor:
    """Where each global position sits in the rank-major concatenation of every rank's tokens."""
    held = torch.cat([local_positions(length, cp, r, device) for r in range(cp)])
    return torch.argsort(held)


def split_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's tokens of ``x`` (its sequence along ``dim``), in local order."""
    index = local_positions(x.shape[dim], cp, rank, x.device)
    return x.index_select(dim, index)


def group_of(model_or_group) -> ContextParallelGroup:
    """The :class:`ContextParallelGroup` of a model ``context_parallel`` was applied to (or the group itself)."""
    if isinstance(model_or_group, ContextParallelGroup):
        return model_or_group
    found = getattr(model_or_group, "_schedlang_context_parallel", None)
    if found is None:
        for sub in getattr(model_or_group, "modules", lambda: ())():
            found = getattr(sub, "_schedlang_context_parallel", None)
            if found is not None:
                break
    if found is None:
        raise ScheduleValueError(f"context_parallel: {type(model_or_group).__name__} is neither a model "
                                 f"context_parallel was applied to nor a ContextParallelGroup; pass the model the "
                                 f"primitive was applied to, or its group")
    return found


def gather_sequence(x: torch.Tensor, dim: int, cp_group, grad_is_replicated: bool = False) -> torch.Tensor:
    """Every rank's tokens of ``x`` along ``dim``, in global order (the inverse of :func:`split_sequence`).

    Differentiable: the gradient is reduce-scattered back (``grad_is_replicated=False``: each rank's
    gradient is partial) or sliced (``True``: every rank computed the same downstream function).
    ``cp_group``: a :class:`ContextParallelGroup` or the model ``context_parallel`` was applied to."""
    cp_group = group_of(cp_group)
    if cp_group.size == 1:
        return x
    full = gather_forward(x.contiguous(), dim, cp_group.group, grad_is_replicated=grad_is_replicated)
    return full.index_select(dim, _global_order(full.shape[dim], cp_group.size, x.device))


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: Optional[int]) -> torch.Tensor:
    """``[q, k]`` bool, True where the query may attend: causal, within the window when there is one."""
    distance = q_pos[:, None] - k_pos[None, :]
    allowed = distance >= 0
    if sliding_window is not None:
        allowed = allowed & (distance < sliding_window)
    return allowed


def context_parallel_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                               scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                               softcap: Optional[float] = None, **kwargs):
    """transformers' attention-function signature over context-parallel tokens.

    ``query`` ``[b, h, l, d]`` holds this rank's ``l`` tokens, ``key`` / ``value`` ``[b, h_kv, l, d]``
    likewise; returns ``([b, l, h, d], None)``. ``attention_mask`` is ignored: the primitive refuses
    padding, and causality (and the window) come from global positions."""
    cp_group: ContextParallelGroup = module._schedlang_context_parallel
    if kwargs.get("s_aux") is not None:
        raise ScheduleValueError(f"{type(module).__name__}: context-parallel attention has no attention sinks; "
                                 f"only attention without sinks (s_aux=None) is supported")
    local = query.shape[2]
    length = local * cp_group.size
    keys, values = (_shape_only_gather(t, cp_group.size) if _is_fake(t) else gather_sequence(t, 2, cp_group)
                    for t in (key, value))
    q_pos = local_positions(length, cp_group.size, cp_group.rank, query.device)
    k_pos = torch.arange(length, device=query.device)
    allowed = _mask(q_pos, k_pos, sliding_window)
    dropout = dropout if module.training else 0.0
    if softcap is None:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, dropout_p=dropout,
                                             scale=scaling, enable_gqa=keys.shape[1] != query.shape[1])
    else:
        # tanh soft-capping of the scores (Gemma-2) has no SDPA form: the plain computation
        groups = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        scores = torch.matmul(query, keys.transpose(2, 3)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        weights = F.dropout(weights, p=dropout, training=module.training)
        out = torch.matmul(weights, values)
    return out.transpose(1, 2).contiguous(), None


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _shape_only_gather(t: torch.Tensor, cp: int) -> torch.Tensor:
    """Fake tensors (a shape pass, e.g. the pipeline's split of the model at build) carry no values and have no
    peers to exchange them with: every rank's part has this part's shape, so the gathered shape is enough."""
    return torch.cat([t] * cp, dim=2)


class SplitInputs:
    """A forward pre-hook that keeps this rank's tokens of the full ``[b, L]`` batch, with their global
    ``position_ids``: on the model's root (``context_parallel``), and under a pipeline on the first stage,
    which takes the model's inputs in its place (the root's forward is then never called).

    ``names``: the hooked forward's parameters in order (positional arguments are bound to them);
    ``where``: the schedule path (or stage) its messages name."""

    def __init__(self, names: Sequence[str], cp_group: ContextParallelGroup, where: str):
        self.names, self.cp_group, self.where = list(names), cp_group, where

    def __deepcopy__(self, memo):
        return self

    def __call__(self, module, args, kwargs):
        kwargs = {**dict(zip(self.names, args)), **kwargs}
        if kwargs.get("labels") is not None:
            raise ScheduleValueError(
                f"{self.where}: under context_parallel the model's own loss would shift labels within each rank's "
                f"tokens; call it without labels= and compute the loss with schedlang.context_parallel_loss(logits, "
                f"labels, model)")
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(torch.all(mask != 0)):
            raise ScheduleValueError(
                f"{self.where}: context_parallel does not support padding: attention_mask has zeros; pass sequences "
                f"without padding (attention_mask=None or all ones)")
        if "attention_mask" in self.names:
            kwargs["attention_mask"] = None
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None:
            raise ScheduleValueError(f"{self.where}: context_parallel splits input_ids or inputs_embeds, and neither "
                                     f"was given")
        length = tokens.shape[1]
        check_sequence_length(length, self.cp_group.size, self.where)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=tokens.device).expand(tokens.shape[0], -1)
        elif positions.shape[-1] != length:
            raise ScheduleValueError(f"{self.where}: position_ids cover {positions.shape[-1]} tokens, the inputs "
                                     f"{length}; pass the global positions of the full sequence")
        for key in ("input_ids", "inputs_embeds"):
            if kwargs.get(key) is not None:
                kwargs[key] = split_sequence(kwargs[key], 1, self.cp_group.size, self.cp_group.rank)
        kwargs["position_ids"] = split_sequence(positions, positions.dim() - 1, self.cp_group.size, self.cp_group.rank)
        if "use_cache" in self.names:
            kwargs["use_cache"] = False  # a cache of this rank's keys alone would be wrong to reuse
        return (), kwargs


def split_for_context_parallel(input_ids: torch.Tensor, labels: Optional[torch.Tensor], cp_group: ContextParallelGroup,
                               ignore_index: int = -100, where: str = "context_parallel"):
    """``(input_ids, shifted_labels, position_ids)`` of this rank, from the full ``[b, L]`` batch.

    The labels are shifted on the full sequence first (token ``t`` predicts ``labels[t + 1]``; the last
    token predicts nothing), so a rank holding the end of a chunk still gets its target."""
    check_sequence_length(input_ids.shape[1], cp_group.size, where)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
    split = [split_sequence(t, 1, cp_group.size, cp_group.rank) for t in (input_ids, positions)]
    shifted = None
    if labels is not None:
        shifted = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
        shifted = split_sequence(shifted, 1, cp_group.size, cp_group.rank)
    return split[0], shifted, split[1]


def context_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, cp_group, ignore_index: int = -100,
                          shifted: bool = False) -> torch.Tensor:
    """Mean next-token cross entropy over the whole sequence, from this rank's logits ``[b, l, V]``.

    ``labels``: the full ``[b, L]`` labels (``shifted=False``: shifted here, on the full sequence), or
    this rank's already shifted ones (``shifted=True``, from :func:`split_for_context_parallel`).
    The value is the single process's loss on every rank. Its gradient is ``cp`` times this rank's
    share, so averaging parameter gradients over ``cp`` (as ``build`` does) gives the single
    process's gradient. ``cp_group``: a :class:`ContextParallelGroup` or the model ``context_parallel``
    was applied to.

    Example::

        logits = model(input_ids).logits                       # this rank's tokens
        loss = schedlang.context_parallel_loss(logits, input_ids, model)
        loss.backward()
    """
    cp_group = group_of(cp_group)
    if not shifted:
        labels = split_for_context_parallel(labels, labels, cp_group, ignore_index, "context_parallel_loss")[1]
    token_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                ignore_index=ignore_index, reduction="sum")
    totals = torch.stack([token_sum.detach(), (labels != ignore_index).sum().to(token_sum.dtype)])
    if cp_group.size > 1:
        import torch.distributed as dist

        dist.all_reduce(totals, group=cp_group.group)
    count = totals[1].clamp(min=1)
    scaled = token_sum * cp_group.size / count
    # the value is the global mean; the gradient is this rank's scaled share
    return scaled + (totals[0] / count - scaled).detach()


def average_gradients_over(module: torch.nn.Module, cp_group: ContextParallelGroup) -> int:
    """Average every parameter's gradient over the ``cp`` ranks once it is accumulated (without data
    parallelism, nothing else sums what each rank's tokens contributed). Returns the hooks' count."""
    import torch.distributed as dist

    def average(param):
        grad = param.grad
        local = getattr(grad, "_local_tensor", grad)  # a DTensor gradient (tensor parallel): its shard
        dist.all_reduce(local, group=cp_group.group)
        local.div_(cp_group.size)

    count = 0
    for param in module.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(average)
            count += 1
    return count


def register_attention() -> None:
    """Register :func:`context_parallel_attention` in transformers' AttentionInterface (once)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)


def attention_modules(module: torch.nn.Module) -> Sequence[tuple]:
    """``(path, module)`` of every submodule whose forward dispatches through transformers'
    ``ALL_ATTENTION_FUNCTIONS``."""
    found = []
    for path, sub in module.named_modules():
        # through decorators (transformers wraps forwards to rename deprecated arguments)
        code = getattr(inspect.unwrap(type(sub).forward), "__code__", None)
        if code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names:
            found.append((path, sub))
    return found

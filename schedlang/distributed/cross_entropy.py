"""Vocabulary-parallel cross entropy: the loss of logits that stay split along the vocabulary.

A column-parallel LM head (weight sharded along the vocabulary) leaves each rank with the
logits of its slice of the vocabulary, ``V / world`` columns. Gathering them costs an
all-gather of ``tokens x V`` values and a full-size softmax on every rank; the loss needs
much less. With ``z`` the logits of one token, ``t`` its label and ``m`` the max over the
whole vocabulary::

    loss = log(sum_j exp(z_j - m)) - (z_t - m)

Each term is a sum over the vocabulary, so each rank computes its part over its own
columns and three all-reduces of ``tokens`` values each (max, sum of exponentials, target
logit) make them global. The gradient is local as well: ``softmax(z) - onehot(t)``, for this
rank's columns only, scaled by the upstream gradient and ``1 / (number of counted tokens)``.

Results equal ``F.cross_entropy(full_logits, labels, ignore_index=...)``: labels equal to
``ignore_index`` count neither in the sum nor in the mean's denominator.

Use from a schedule (the model helpers in :mod:`schedlang.models` do this for you)::

    sch["lm_head"].shard("weight", axis=0)                      # logits stay split
    sch["lm_head"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    model, opt = schedlang.build(sch, ...)
    use_vocab_parallel_loss(model)                              # HF: model(ids, labels=ids).loss works
    # or, without HF's loss: loss = vocab_parallel_cross_entropy(logits, labels)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import ScheduleTypeError, ScheduleValueError
from .groups import rank as _rank
from .groups import world_size as _world_size

__all__ = ["vocab_parallel_cross_entropy", "VocabParallelCausalLMLoss", "VocabParallelMaskedLMLoss",
           "use_vocab_parallel_loss"]

_REDUCTIONS = ("mean", "sum", "none")


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if _world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, ignore_index, reduction):
        vocab_local = logits.shape[-1]
        start = _rank(group) * vocab_local
        # statistics in float32 at least (float64 stays float64); `shifted` is a new tensor, reused in place below
        wide = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        global_max = _all_reduce(wide.max(dim=-1).values, dist.ReduceOp.MAX, group)
        shifted = wide - global_max.unsqueeze(-1)
        del wide
        valid = labels != ignore_index
        in_shard = valid & (labels >= start) & (labels < start + vocab_local)
        local_target = torch.where(in_shard, labels - start, torch.zeros_like(labels))
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * in_shard
        target_logit = _all_reduce(target_logit, dist.ReduceOp.SUM, group)
        exp = shifted.exp_()
        sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
        per_token = (torch.log(sum_exp) - target_logit) * valid
        count = valid.sum()
        if reduction == "mean":
            loss = per_token.sum() / count
        elif reduction == "sum":
            loss = per_token.sum()
        else:
            loss = per_token
        ctx.save_for_backward(exp, sum_exp, local_target, in_shard, valid, count)
        ctx.reduction = reduction
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        exp, sum_exp, local_target, in_shard, valid, count = ctx.saved_tensors
        # d loss_i / d z_ij = softmax_ij - [j == t_i]; computed in place on the saved exponentials
        grad = exp.div_(sum_exp.unsqueeze(-1))
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -in_shard.unsqueeze(-1).to(grad.dtype))
        if ctx.reduction == "mean":
            scale = valid.to(grad.dtype) * (grad_loss / count)
        elif ctx.reduction == "sum":
            scale = valid.to(grad.dtype) * grad_loss
        else:
            scale = valid.to(grad.dtype) * grad_loss
        grad.mul_(scale.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, group=None,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of logits split along the vocabulary over ``group``.

    ``local_logits`` has shape ``(..., V / world)``: rank r holds the columns of vocabulary ids
    ``[r * V / world, (r + 1) * V / world)``, as a column-parallel LM head leaves them.
    ``labels`` (shape ``(...)``, the same on every rank) are ids of the full vocabulary.
    Loss and gradient equal ``F.cross_entropy`` of the gathered logits (``reduction`` in
    ``"mean"`` (over tokens whose label is not ``ignore_index``), ``"sum"``, ``"none"``). The
    gradient of ``local_logits`` is this rank's columns of the full gradient.

    Example::

        logits = model(ids).logits                    # (batch, seq, V / world) on every rank
        loss = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:])
        loss.backward()
    """
    if reduction not in _REDUCTIONS:
        raise ScheduleValueError(f"vocab_parallel_cross_entropy: invalid reduction {reduction!r}: valid are "
                                 f"{', '.join(_REDUCTIONS)}")
    if not local_logits.is_floating_point():
        raise ScheduleTypeError(f"vocab_parallel_cross_entropy: logits must be floating point, got "
                                f"{local_logits.dtype}")
    if tuple(labels.shape) != tuple(local_logits.shape[:-1]):
        raise ScheduleValueError(
            f"vocab_parallel_cross_entropy: labels of shape {tuple(labels.shape)} do not match logits of shape "
            f"{tuple(local_logits.shape)}: labels need the logits' shape without the last (vocabulary) axis")
    labels = labels.to(device=local_logits.device, dtype=torch.long)
    return _VocabParallelCrossEntropy.apply(local_logits, labels, group, ignore_index, reduction)


class _HFLoss:
    """Base of the HF ``loss_function`` replacements: check the vocabulary, reduce like HF does."""

    def __init__(self, group=None):
        self.group = group

    def __deepcopy__(self, memo):  # process groups cannot be copied; copies share the group
        return type(self)(self.group)

    def _loss(self, logits, labels, vocab_size, num_items_in_batch, ignore_index):
        world = _world_size(self.group)
        if vocab_size is not None and logits.shape[-1] * world != vocab_size:
            raise ScheduleValueError(
                f"{type(self).__name__}: logits have {logits.shape[-1]} vocabulary columns on each of {world} ranks "
                f"({logits.shape[-1] * world} in all) but the model's vocabulary has {vocab_size}: the vocabulary-"
                "parallel loss needs the LM head sharded along the vocabulary over the same group")
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), self.group,
                                            ignore_index, reduction)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


class VocabParallelCausalLMLoss(_HFLoss):
    """Drop-in for HF's causal-LM ``loss_function`` when logits are split along the vocabulary.

    Shifts the labels by one (token i predicts token i + 1), like ``ForCausalLMLoss``.

    Example::

        model.loss_function = VocabParallelCausalLMLoss(group)
        loss = model(input_ids=ids, labels=ids).loss
    """

    def __call__(self, logits, labels, vocab_size: Optional[int] = None, num_items_in_batch=None,
                 ignore_index: int = -100, shift_labels: Optional[torch.Tensor] = None, **kwargs):
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return self._loss(logits, shift_labels.to(logits.device), vocab_size, num_items_in_batch, ignore_index)


class VocabParallelMaskedLMLoss(_HFLoss):
    """Drop-in for HF's masked-LM ``loss_function`` (no shift) when logits are split along the vocabulary."""

    def __call__(self, logits, labels, vocab_size: Optional[int] = None, num_items_in_batch=None,
                 ignore_index: int = -100, **kwargs):
        return self._loss(logits, labels.to(logits.device), vocab_size, num_items_in_batch, ignore_index)


def use_vocab_parallel_loss(model: nn.Module, group=None, kind: Optional[str] = None) -> nn.Module:
    """Make a HF model compute its loss with :func:`vocab_parallel_cross_entropy`; returns the model.

    For models that call ``self.loss_function`` (LLaMA, GPT-2 and most causal LMs in
    transformers 5.x). ``kind`` is ``"causal"`` (labels shifted) or ``"masked"``; by default it
    follows the model's ``loss_type``. Pass a built model, or a schedule (its working model is
    changed, which ``build`` returns). This sets an attribute and is not a step of the plan:
    ``Verify`` and ``replay`` do not see it.

    Example::

        model, opt = schedlang.build(sch, optimizer="adamw")
        use_vocab_parallel_loss(model)
        model(input_ids=ids, labels=ids).loss.backward()
    """
    if hasattr(model, "root") and hasattr(model, "plan"):  # a Schedule
        group = model.group if group is None else group
        model = model.root.mod
    if not isinstance(model, nn.Module) or not hasattr(type(model), "loss_function"):
        raise ScheduleTypeError(
            f"use_vocab_parallel_loss: {type(model).__name__} has no HF loss_function to replace; call "
            "vocab_parallel_cross_entropy(logits, labels) on the model's output instead")
    if kind is None:
        kind = "masked" if "MaskedLM" in str(getattr(model, "loss_type", "") or "") else "causal"
    if kind not in ("causal", "masked"):
        raise ScheduleValueError(f"use_vocab_parallel_loss: invalid kind {kind!r}: valid kinds are causal, masked")
    model.loss_function = (VocabParallelCausalLMLoss if kind == "causal" else VocabParallelMaskedLMLoss)(group)
    return model

"""Selective activation checkpointing of the trainer's decoder layers (``--activation-checkpoint selective``).

Each layer runs under ``torch.utils.checkpoint`` (non-reentrant) with a selective policy
(``create_selective_checkpoint_contexts``): of the layer's matmuls, in call order, the first, third, fifth ...
keep their outputs (q, v, the MLP's gate and its down projection in a LLaMA layer), and attention's outputs
are kept; every other op (the remaining matmuls, norms, rotary embeddings, the activation function) is
recomputed in the backward. This is the op-level policy torchtitan calls selective, and what the planner
(:mod:`schedlang.autotune.step_cost`) counts for it.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["selective_policy", "checkpoint_selectively"]

_aten = torch.ops.aten
#: the ops a Linear runs as (2-D matmul, with or without its bias)
MATMULS = frozenset({_aten.mm.default, _aten.addmm.default})
#: attention kernels whose outputs are kept (their recomputation is the costly part of attention)
ATTENTION = frozenset(getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(_aten, name))


def selective_policy() -> Callable:
    """A policy for one call of a layer: counts the matmuls of the forward and of its recomputation apart, so
    that both make the same choice for the same matmul."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op in MATMULS:
            counts[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 == 1 else \
                CheckpointPolicy.PREFER_RECOMPUTE
        if op in ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _contexts():
    return create_selective_checkpoint_contexts(selective_policy())


def checkpoint_selectively(layer: nn.Module) -> None:
    """Run ``layer``'s forward under selective checkpointing (where gradients are recorded)."""
    forward = layer.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

    layer.forward = checkpointed

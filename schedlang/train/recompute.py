"""Selective activation checkpointing of the trainer's decoder layers (``--activation-checkpoint selective``).

Each layer runs under ``torch.utils.checkpoint`` (non-reentrant) with a selective policy
(``create_selective_checkpoint_contexts``): of the layer's matmuls, in call order, the first, third, fifth ...
keep their outputs (q, v, the MLP's gate and its down projection in a LLaMA layer), and attention's outputs
are kept; every other op (the remaining matmuls, norms, rotary embeddings, the activation function) is
recomputed in the backward. This is the op-level policy torchtitan calls selective, and what the planner
(:mod:`schedlang.autotune.step_cost`) counts for it.

A compiled layer must be checkpointed *before* it is compiled: ``torch.compile`` then traces the checkpoint
with its policy, so the compiler's partitioner saves exactly the policy's outputs and recomputes the rest
inside the compiled backward. The other order (a checkpoint around already compiled code) saves nothing the
policy names and, in the backward, replays the whole layer *uncompiled* (the checkpoint disables the compiler
for its recomputation): slower than full checkpointing for about its memory. :func:`checkpoint_selectively`
refuses a compiled forward for that reason.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..errors import ScheduleValueError

__all__ = ["selective_policy", "checkpoint_selectively", "trace_checkpoints_whole"]

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


def checkpoint_selectively(layer: nn.Module, where: str = "layer") -> None:
    """Run ``layer``'s forward under selective checkpointing (where gradients are recorded); compile the layer
    afterwards, if at all. ``where`` names the layer in errors (its path in the model)."""
    forward = layer.forward
    if getattr(forward, "_torchdynamo_orig_callable", None) is not None:
        raise ScheduleValueError(
            f"{where}: selective checkpointing got an already compiled forward; a checkpoint around compiled "
            "code recomputes the whole layer uncompiled in the backward and saves none of the "
            "policy's outputs; checkpoint the layer first, then torch.compile it (compile_layers after "
            "checkpoint_selectively)")

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

    layer.forward = checkpointed



def trace_checkpoints_whole(layer: nn.Module) -> None:
    """Run ``layer``'s compiled forward (checkpointed, then compiled) with the compiler allowed to trace a
    checkpoint whose forward sets state outside itself. transformers' attention, where the ``kernels`` package is
    installed, sets and resets a context variable in its forward; the compiler refuses that inside a checkpoint
    (it could not replay the set in the recomputation), breaks the layer's graph there and runs the checkpoint
    eagerly, so the layer would recompute uncompiled in the backward. The variable is reset before the forward
    returns: not replaying the set changes nothing. The setting holds during the layer's calls only (where the
    compiler traces and recompiles), not process-wide."""
    if not hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        return  # a torch without the setting: the graph break stays, the numerics are the same
    forward = layer.forward

    @functools.wraps(forward)
    def traced_whole(*args, **kwargs):
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            return forward(*args, **kwargs)

    layer.forward = traced_whole

"""The shard rule for a mixture-of-experts block whose experts are stored as 3-D tensors (transformers 5.x).

transformers keeps a block's experts in one module (``MixtralExperts`` and the like) holding
``gate_up_proj`` (``(experts, 2 x intermediate, hidden)``, or transposed) and ``down_proj``
(``(experts, hidden, intermediate)``, or transposed), and its ``use_experts_implementation``
decorator records the layout on the module: ``is_concatenated`` (gate then up, or interleaved),
``is_transposed``, ``has_bias``, ``has_gate``, ``has_post_expert_norm``.

Every expert is then split like a dense MLP: its gate and up projections along the intermediate
width (column-parallel; rank r keeps [gate_r, up_r] of each expert, so the fused tensor is split
in two blocks), its down projection along the same width (row-parallel), so each rank computes a
partial sum of every expert's output. This rule, the rule of the experts' *parent* (the MoE block),
answers the primitive's question about the layout of the fused ``gate_up_proj``; the plan
(:mod:`schedlang.models.moe`) writes the shards and the syncs: the experts' output all-reduced, and
the gradients of their inputs summed in backward. Those inputs are the tokens *and* the routing
weights (each rank's gradient of a routing weight covers only its part of the expert's output), so
once the experts are split the rule installs :class:`InputGradientSync`, which routes every tensor
input after the first through the experts' ``bwd_post`` sync point too (the sync primitive itself
acts on the first). :func:`experts_layout` says why a
layout cannot be split (interleaved gate and up, a down-projection bias added per expert, a norm
after each expert), and the plan keeps such experts whole instead.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from ...errors import ShardError
from . import ShardRule, register_fallback_rule

__all__ = ["is_experts", "experts_layout", "ExpertsLayout", "MoEBlockShardRule", "InputGradientSync"]


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds a block's experts as 3-D tensors laid out as transformers' decorator records."""
    weights = module._parameters
    gate_up = weights.get("gate_up_proj") if getattr(module, "has_gate", True) else weights.get("up_proj")
    down = weights.get("down_proj")
    return (gate_up is not None and down is not None and gate_up.dim() == 3 and down.dim() == 3
            and hasattr(module, "is_concatenated"))


class ExpertsLayout:
    """Where each expert tensor is split: ``axes`` name -> (axis, blocks) of the tensors to split."""

    def __init__(self, module: nn.Module):
        transposed = bool(getattr(module, "is_transposed", False))
        gated = bool(getattr(module, "has_gate", True))
        up = "gate_up_proj" if gated else "up_proj"
        self.axes: Dict[str, tuple] = {up: (2 if transposed else 1, 2 if gated else 1),
                                       "down_proj": (1 if transposed else 2, 1)}
        if getattr(module, "has_bias", False) and f"{up}_bias" in module._parameters:
            self.axes[f"{up}_bias"] = (1, 2 if gated else 1)


def experts_layout(module: nn.Module) -> Optional[str]:
    """None if ``module``'s experts can be split like dense MLPs, else why not."""
    if not is_experts(module):
        return "its experts are not 3-D tensors laid out as transformers records them"
    if getattr(module, "has_gate", True) and not getattr(module, "is_concatenated", True):
        return "gate and up are interleaved in gate_up_proj"
    if getattr(module, "has_bias", False) and module._parameters.get("down_proj_bias") is not None:
        return "each expert adds its down-projection bias before the experts' outputs are summed"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm runs on each expert's output, which a rank holds only a part of"
    return None


class InputGradientSync:
    """Forward pre-hook of split experts: every floating tensor input after the first (the routing weights)
    goes through the module's ``bwd_post`` sync point (an all-reduce of its gradient); without one it
    passes unchanged."""

    def __call__(self, module: nn.Module, args, kwargs):
        from ..sync_ops import sync_children

        syncs = [op for _, op in sync_children(module) if op.mode == "bwd_post"]
        if not syncs:
            return args, kwargs
        # the first tensor (positional, else keyword) is the one the sync primitive's own hook handles
        first = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
        first_key = None if first is not None else next(
            (k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)

        def summed(x, skip):
            return syncs[0](x) if not skip and isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return (tuple(summed(a, i == first) for i, a in enumerate(args)),
                {k: summed(v, k == first_key) for k, v in kwargs.items()})

    def __repr__(self) -> str:
        return "InputGradientSync()"


def _generic():
    from .generic_block import GenericBlockShardRule

    return GenericBlockShardRule


class MoEBlockShardRule(ShardRule):
    """A module holding experts (:func:`is_experts`) as a child: the layout of their fused tensors. Its other
    children (a shared expert's gate, say) are left to the generic rule."""

    @classmethod
    def applies_to(cls, module: nn.Module) -> bool:
        return any(is_experts(c) for c in module.children())

    @classmethod
    def check_child_shard(cls, path, module, child_name, child, tensor_name, axis, world_size):
        if not is_experts(child):
            generic = _generic()
            return generic.check_child_shard(path, module, child_name, child, tensor_name, axis, world_size) \
                if generic.applies_to(module) else 1
        why = experts_layout(child)
        layout = ExpertsLayout(child)
        if why is not None or tensor_name not in layout.axes:
            raise ShardError(f"{path or '<root>'}: cannot shard '{tensor_name}' of "
                             f"{type(child).__name__}: {why or 'not an expert weight split with the intermediate width'}"
                             f"; valid are {', '.join(f'{n} along axis {a}' for n, (a, _) in layout.axes.items())} of "
                             "experts laid out as gate then up")
        want, blocks = layout.axes[tensor_name]
        if axis != want:
            raise ShardError(f"{path or '<root>'}: cannot shard '{tensor_name}' of {type(child).__name__} "
                             f"along axis {axis}: valid is axis {want}, the intermediate width of its experts")
        return blocks

    @classmethod
    def after_child_shard(cls, module, child_name, child, tensor_name, axis, world_size, rank):
        if not is_experts(child):
            generic = _generic()
            if generic.applies_to(module):
                generic.after_child_shard(module, child_name, child, tensor_name, axis, world_size, rank)
            return
        if not any(isinstance(h, InputGradientSync) for h in child._forward_pre_hooks.values()):
            child.register_forward_pre_hook(InputGradientSync(), with_kwargs=True)


def _register() -> None:
    from .generic_block import GenericBlockShardRule

    # asked before the generic rule, which also applies to a block holding a projection beside its experts
    register_fallback_rule(MoEBlockShardRule, before=GenericBlockShardRule)


_register()

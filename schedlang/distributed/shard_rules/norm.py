"""Norms under tensor and sequence parallelism: ``nn.LayerNorm``, ``nn.RMSNorm`` and HF's RMSNorms.

A norm normalizes over the whole hidden size, so its weights are never split: the shard rule
here refuses it. Under tensor parallelism a norm sits outside the parallel regions and sees
the same full activations on every rank, so nothing needs doing.

Under sequence parallelism (Megatron-SP) each rank normalizes only its slice of the sequence.
The output is still exact, but each rank's weight gradient covers only its tokens: the
gradients must be summed over the group. :func:`make_sequence_parallel_norm` returns the
sequence-parallel form of a norm: the same module, sharing the same ``Parameter`` objects, whose
forward passes each weight through an identity whose backward all-reduces the gradient
(:func:`schedlang.distributed.collectives.reduce_backward`). The sum happens inside autograd, so
``loss.backward()`` leaves the full gradient on every rank, with no extra step in the training
loop. Use it through ``replace_all`` (see :mod:`schedlang.distributed.sequence_parallel`)::

    from schedlang.distributed.sequence_parallel import sequence_parallel_norms
    sequence_parallel_norms(sch["model"], LlamaRMSNorm)
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ScheduleTypeError, ShardError
from ..collectives import reduce_backward
from . import ShardRule, register_shard_rule

__all__ = ["NormShardRule", "make_sequence_parallel_norm", "is_sequence_parallel_norm", "LLAMA_STYLE_RMSNORMS"]

#: HF RMSNorm classes computing ``weight * (x / rms(x)).to(input dtype)`` in float32, as LlamaRMSNorm does
LLAMA_STYLE_RMSNORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")

_GROUP_ATTR = "_schedlang_sequence_parallel_group"


class _GroupRef:
    """Holds a process group; copies of a model share it (process groups cannot be deep-copied)."""

    def __init__(self, group):
        self.group = group

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return "world" if self.group is None else repr(self.group)


#: set on a norm by ``schedlang.models.compile_layers(trace_collectives=False)``: the gradient sum runs eagerly
EAGER_COLLECTIVES_ATTR = "_schedlang_eager_collectives"
_eager_reduce_backward = torch.compiler.disable(reduce_backward)


def _summed(module: nn.Module, tensor):
    """``tensor`` passed through an identity whose backward sums the gradient over the norm's group."""
    if tensor is None:
        return None
    group = module.__dict__[_GROUP_ATTR].group
    if module.__dict__.get(EAGER_COLLECTIVES_ATTR, False):
        return _eager_reduce_backward(tensor, group)
    return reduce_backward(tensor, group)


def _layer_norm_forward(self, input: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(input, self.normalized_shape, _summed(self, self.weight), _summed(self, self.bias), self.eps)


def _torch_rms_norm_forward(self, input: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(input, self.normalized_shape, _summed(self, self.weight), self.eps)


def _llama_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # LlamaRMSNorm's arithmetic (float32 statistics, weight applied in the input dtype), with the weight's
    # gradient summed over the sequence-parallel group
    weight = _summed(self, self.weight)
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return weight * hidden_states.to(input_dtype)


_SP_CLASSES: Dict[type, type] = {}


def _forward_for(module: nn.Module):
    if isinstance(module, nn.LayerNorm):
        return _layer_norm_forward
    if hasattr(nn, "RMSNorm") and isinstance(module, nn.RMSNorm):
        return _torch_rms_norm_forward
    if type(module).__name__ in LLAMA_STYLE_RMSNORMS:
        return _llama_rms_norm_forward
    return None


def is_sequence_parallel_norm(module: nn.Module) -> bool:
    """Whether ``module`` is the sequence-parallel form made by :func:`make_sequence_parallel_norm`."""
    return _GROUP_ATTR in module.__dict__


def make_sequence_parallel_norm(path: str, module: nn.Module, group=None) -> nn.Module:
    """The sequence-parallel form of the norm ``module`` (a new module sharing its parameters).

    Matches ``replace_all``'s ``make_fn(path, old_module)``; ``group`` is the sequence-parallel
    group (None: the world). Supported: ``nn.LayerNorm``, ``nn.RMSNorm`` and the HF RMSNorms in
    :data:`LLAMA_STYLE_RMSNORMS`.

    Example::

        sch["model"].replace_all(LlamaRMSNorm, functools.partial(make_sequence_parallel_norm, group=sch.group))
    """
    if is_sequence_parallel_norm(module):
        return module
    forward = _forward_for(module)
    if forward is None:
        raise ScheduleTypeError(
            f"{path or '<root>'}: no sequence-parallel form for {type(module).__name__}; supported norms: "
            f"nn.LayerNorm, nn.RMSNorm, {', '.join(LLAMA_STYLE_RMSNORMS)}")
    base = type(module)
    klass = _SP_CLASSES.get(base)
    if klass is None:
        # the name keeps "LayerNorm" / "RMSNorm", which HF's _init_weights looks for
        klass = type(f"SequenceParallel{base.__name__}", (base,), {"forward": forward, "__module__": __name__})
        _SP_CLASSES[base] = klass
    new = base.__new__(klass)
    state = {}
    for key, value in module.__dict__.items():
        state[key] = type(value)(value) if isinstance(value, dict) else value  # own dicts, same tensors
    new.__dict__.update(state)
    new.__dict__[_GROUP_ATTR] = _GroupRef(group)
    return new


@register_shard_rule
class NormShardRule(ShardRule):
    module_types = (nn.LayerNorm,) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
    module_type_names = LLAMA_STYLE_RMSNORMS + tuple(f"SequenceParallel{n}" for n in LLAMA_STYLE_RMSNORMS)
    match_subclasses = True

    @classmethod
    def check(cls, path, module, tensor_name, axis, world_size):
        raise ShardError(
            f"{path or '<root>'}: cannot shard '{tensor_name}' of {type(module).__name__}: a norm normalizes over the "
            "whole hidden size, so its weights stay whole on every rank; for sequence parallelism use its "
            "sequence-parallel form (schedlang.distributed.sequence_parallel.sequence_parallel_norms)")

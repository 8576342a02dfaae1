"""Tensor-parallel parameters as DTensors: one record of where every shard belongs.

At build, every parameter of a tensor-parallel model becomes a ``DTensor`` on the mesh's ``tp``
dimension: ``Shard(axis)`` for a tensor split by ``shard`` (a block-wise split of a fused tensor,
GPT-2's q|k|v, is ``_StridedShard(axis, split_factor=blocks)``: rank r holds part r of every
block), ``Replicate()`` for every other one. Sharded buffers become DTensors too; replicated
buffers stay plain tensors. That placement is what FSDP2 (2-D sharding), distributed checkpoints
(resharding to another layout), the optimizers and ``export_hf`` read.

The forward still runs on local tensors, as the shard rules arranged it: a forward pre-hook on
each module that owns DTensors puts their local tensors (``to_local()``, differentiable) in their
place for the duration of its forward, and a forward hook puts the DTensors back. Gradients
therefore arrive as DTensors with the parameter's placement.

Example::

    model, opt = schedlang.build(sch)              # sch made with a tp mesh (or group) of 2 ranks
    model.model.layers[0].mlp.up_proj.weight       # DTensor(..., placements=(Shard(dim=0),))
"""

from __future__ import annotations

import logging
from typing import Dict, List

import torch
from torch import nn

__all__ = ["distribute_parameters", "placement_of", "is_dtensor", "local_tensor", "LOCAL_VIEW_ATTR"]

logger = logging.getLogger("schedlang.distributed.dtensor_params")

#: attribute (on a module) holding the DTensors its forward pre-hook swapped out, innermost call last
LOCAL_VIEW_ATTR = "_schedlang_dtensors_in_forward"


def is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def placement_of(spec):
    """The DTensor placement for a ``ShardSpec`` (None: replicated)."""
    from torch.distributed.tensor import Replicate, Shard

    if spec is None:
        return Replicate()
    blocks = getattr(spec, "blocks", None)
    if blocks is not None and len(set(blocks)) > 1:
        from ..errors import ShardError

        raise ShardError(f"build: a fused tensor of {spec.full_shape} is split in blocks of unequal widths "
                         f"({', '.join(map(str, blocks))} along axis {spec.axis}), which no DTensor placement "
                         "describes, so build cannot make it a DTensor; split the fused projection into separate "
                         "q, k and v projections before sharding, or use blocks of equal widths (as many key/value "
                         "heads as query heads)")
    if spec.groups == 1:
        return Shard(spec.axis)
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(spec.axis, split_factor=spec.groups)


def _contiguous_stride(shape) -> tuple:
    stride, running = [], 1
    for size in reversed(tuple(shape)):
        stride.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(stride))


def _to_dtensor(t: torch.Tensor, spec, mesh, is_param: bool) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    shape = tuple(spec.full_shape) if spec is not None else tuple(t.shape)
    # shards are even (shard checks divisibility), so no cross-rank check of the local shapes is needed
    dt = DTensor.from_local(t.detach(), mesh, [placement_of(spec)], run_check=False, shape=torch.Size(shape),
                            stride=_contiguous_stride(shape))
    if not is_param:
        return dt
    new = nn.Parameter(dt, requires_grad=t.requires_grad)
    for key, value in vars(t).items():  # annotations (schedlang's annotate) travel with the parameter
        if not key.startswith("_"):
            setattr(new, key, value)
    return new


def _swap_in_local(module: nn.Module, args):
    swapped: Dict[str, torch.Tensor] = {}
    for store in (module._parameters, module._buffers):
        for name, t in list(store.items()):
            if t is not None and is_dtensor(t):
                swapped[name] = t
                store[name] = t.to_local()
    module.__dict__.setdefault(LOCAL_VIEW_ATTR, []).append(swapped)


def _swap_back(module: nn.Module, args, output):
    stack: List = module.__dict__.get(LOCAL_VIEW_ATTR) or []
    if not stack:
        return None
    swapped = stack.pop()
    for name, t in swapped.items():
        (module._parameters if name in module._parameters else module._buffers)[name] = t
    return None


def _install_local_view(module: nn.Module) -> None:
    if module.__dict__.get(LOCAL_VIEW_ATTR) is not None:
        return
    module.__dict__[LOCAL_VIEW_ATTR] = []
    module.register_forward_pre_hook(_swap_in_local)
    # prepend: the DTensors are back before any later hook (FSDP2's reshard) looks at the module;
    # always_call: also when the forward raises, so the module is never left holding local tensors
    module.register_forward_hook(_swap_back, prepend=True, always_call=True)


def distribute_parameters(model: nn.Module, tp_mesh) -> int:
    """Turn ``model``'s parameters (and sharded buffers) into DTensors on ``tp_mesh``; returns how many.

    Sharding is read from each module's shard records; tied tensors stay tied (one DTensor for all
    holders). Modules owning DTensors get the local-view hooks described in the module docstring.
    """
    from .sharding import shard_specs

    done: Dict[int, tuple] = {}  # id(plain tensor) -> (plain tensor, kept alive so ids stay unique; DTensor)
    count = 0
    for module in model.modules():
        specs = shard_specs(module)
        owns = False
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(store.items()):
                if t is None:
                    continue
                if is_dtensor(t):
                    owns = True
                    continue
                if id(t) in done:
                    store[name] = done[id(t)][1]
                    owns = True
                    continue
                spec = specs.get(name)
                if not is_param and spec is None:
                    continue  # replicated buffers stay plain tensors
                new = _to_dtensor(t, spec, tp_mesh, is_param)
                done[id(t)] = (t, new)
                store[name] = new
                owns = True
                count += 1
        if owns:
            _install_local_view(module)
    logger.info("%d tensors are DTensors on %s", count, tp_mesh)
    return count

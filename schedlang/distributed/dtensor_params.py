"""Tensor-parallel parameters as DTensors: one record of where every shard belongs.

At build, every parameter of a tensor-parallel model becomes a ``DTensor`` on the mesh's ``tp``
dimension: ``Shard(axis)`` for a tensor split by ``shard`` (a block-wise split of a fused tensor,
GPT-2's q|k|v, is ``_StridedShard(axis, split_factor=blocks)``: rank r holds part r of every
block), ``Replicate()`` for every other one. A fused tensor of blocks of *unequal* widths (Phi-3's
q|k|v with fewer key/value heads) is ``Shard(axis)`` of its rank-major re-ordering (see
:func:`placement_of` and :attr:`ShardSpec.rank_major`). Sharded buffers become DTensors too; replicated
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

import contextlib

import logging
from typing import Dict, List

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["distribute_parameters", "placement_of", "is_dtensor", "local_tensor", "LOCAL_VIEW_ATTR",
           "rank_major_spec", "rank_major_specs", "named_shard_specs", "register_rank_major", "to_unsharded",
           "to_rank_major", "placement_indices", "local_part", "hoist_local_views", "HOIST_ATTR", "WRAPPER_NAMES"]

logger = logging.getLogger("schedlang.distributed.dtensor_params")

#: attribute (on a module) holding the DTensors its forward pre-hook swapped out, innermost call last
LOCAL_VIEW_ATTR = "_schedlang_dtensors_in_forward"
#: attribute marking a module whose subtree swaps its DTensors once, around its own call (a compiled layer)
HOIST_ATTR = "_schedlang_hoist_local_views"


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
    """The DTensor placement for a ``ShardSpec`` (None: replicated).

    Blocks of unequal widths (``spec.rank_major``): rank r holds [q_r, k_r, v_r], three separate runs
    of the unsharded tensor of unequal lengths, which neither ``Shard`` nor ``_StridedShard`` (equal
    blocks only) can say. The DTensor then describes the *rank-major* tensor instead, the unsharded
    one with its rows re-ordered so that every rank's shard is one contiguous chunk: ``Shard(axis)``.
    That keeps every engine working unchanged on it (elementwise optimizers, gradient norms, FSDP2's
    second split, DCP's chunks, redistribution), at the price that the DTensor's own global value is
    the re-ordered tensor: what reads the global value maps it back through the spec (the module's
    record, :func:`rank_major_specs`): ``schedlang.checkpoint.full_tensor``, DCP save/load (which
    store the unsharded layout), ``export_hf`` and pretrained loading.
    """
    from torch.distributed.tensor import Replicate, Shard

    if spec is None:
        return Replicate()
    if spec.groups == 1 or spec.rank_major:
        return Shard(spec.axis)
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(spec.axis, split_factor=spec.groups)


# ------------------------------------------------------------------------------------------------ rank-major tensors
# parameter -> its ShardSpec, for parameters whose DTensor holds the rank-major re-ordering (keyed by identity:
# tensors compare elementwise); filled by distribute_parameters and register_rank_major
_RANK_MAJOR = WeakIdKeyDictionary()


def register_rank_major(model: nn.Module) -> int:
    """Remember which DTensor parameters of ``model`` are laid out rank-major (read from the module records),
    so that :func:`rank_major_spec` knows them, also after FSDP2 replaced them; returns how many."""
    from .sharding import shard_specs

    count = 0
    stages = getattr(model, "stage_modules", None)  # a pipeline's stage modules
    for module in [m for part in (stages or [model]) for m in part.modules()]:
        for name, spec in shard_specs(module).items():
            t = module._parameters.get(name)
            if t is None:
                t = module._buffers.get(name)
            if spec.rank_major and t is not None and is_dtensor(t):
                _RANK_MAJOR[t] = spec
                count += 1
    return count


def rank_major_spec(t: torch.Tensor):
    """The ``ShardSpec`` of a parameter laid out rank-major, or of its gradient; None for any other tensor.

    Tensors are known by identity: a parameter of a built model and its ``.grad``. Others shaped
    like it (optimizer state, a detached copy) are not: read their spec from the module record
    (:func:`rank_major_specs`)."""
    if not is_dtensor(t):
        return None
    spec = _RANK_MAJOR.get(t)
    if spec is not None:
        return spec
    for param, spec in list(_RANK_MAJOR.items()):
        if param.grad is t:
            return spec
    return None


#: module names that torch's wrappers insert (torch.compile's module, activation checkpointing's and FSDP1's) and
#: torch's distributed state dict leaves out
WRAPPER_NAMES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def named_shard_specs(modules) -> Dict[str, "object"]:
    """``{tensor name: ShardSpec}`` of every sharded tensor of ``modules`` (a module or a list of them, e.g.
    a pipeline's stage modules, named as in their state dicts)."""
    from .sharding import shard_specs

    out = {}
    for module in [modules] if isinstance(modules, nn.Module) else modules:
        for path, sub in module.named_modules(remove_duplicate=False):
            for name, spec in shard_specs(sub).items():
                # state dicts leave out the wrappers' own names (torch.compile, activation checkpointing)
                parts = [p for p in f"{path}.{name}".split(".") if p and p not in WRAPPER_NAMES]
                out[".".join(parts)] = spec
    return out


def rank_major_specs(modules) -> Dict[str, "object"]:
    """``{tensor name: ShardSpec}`` of the rank-major tensors of ``modules`` (see :func:`named_shard_specs`)."""
    return {name: spec for name, spec in named_shard_specs(modules).items() if spec.rank_major}


def to_unsharded(rank_major: torch.Tensor, spec) -> torch.Tensor:
    """The unsharded tensor from its rank-major re-ordering (plain tensors)."""
    order = spec.rank_major_order().to(rank_major.device)
    return rank_major.index_select(spec.axis, torch.argsort(order))


def to_rank_major(unsharded: torch.Tensor, spec) -> torch.Tensor:
    """The rank-major re-ordering of the unsharded tensor (plain tensors)."""
    return unsharded.index_select(spec.axis, spec.rank_major_order().to(unsharded.device))


def _chunk(indices: torch.Tensor, n: int) -> List[torch.Tensor]:
    """``torch.chunk`` padded with empty pieces to exactly ``n`` (the split DTensor and FSDP2 use)."""
    pieces = list(indices.chunk(n)) if indices.numel() else []
    return pieces + [indices[:0]] * (n - len(pieces))


def _is_strided(placement) -> bool:
    # _StridedShard is not a Shard subclass on every torch version: recognized by name
    return type(placement).__name__ == "_StridedShard"


def _splits(placement) -> bool:
    return _is_strided(placement) or placement.is_shard()


def _fsdp_nested(placements) -> set:
    """Mesh dimensions whose shard is FSDP2's contiguous chunk of a later (tensor-parallel) mesh dimension's shard
    of the same tensor dimension. FSDP2 marks them (or the tensor-parallel shard they split) ``_StridedShard``,
    with a ``split_factor`` torch versions name differently; what the local tensor holds does not depend on it."""
    nested = set()
    for i, outer in enumerate(placements):
        for inner in placements[i + 1:]:
            if (_splits(outer) and _splits(inner) and outer.dim == inner.dim
                    and (_is_strided(outer) or _is_strided(inner))):
                nested.add(i)
    return nested


def placement_indices(shape, placements, coordinate, mesh_sizes) -> List[torch.Tensor]:
    """Per dimension, the indices of the DTensor's global tensor that a rank's local tensor holds, in local
    order (``coordinate``: the rank's position on the mesh).

    ``Shard(d)``: one chunk of dimension ``d``; ``_StridedShard(d, split_factor=k)``: part c of each of k
    blocks (a fused q|k|v weight); FSDP2 over a tensor-parallel shard of the same dimension: a contiguous
    chunk of the tensor-parallel shard (see :func:`_fsdp_nested`)."""
    indices = [torch.arange(int(n)) for n in shape]
    nested = _fsdp_nested(placements)
    steps = [i for i in range(len(placements)) if i not in nested] + sorted(nested, reverse=True)
    for i in steps:
        placement, c, n = placements[i], coordinate[i], mesh_sizes[i]
        if not _splits(placement):
            continue  # Replicate, Partial: the whole (current) extent
        d = placement.dim
        split_factor = getattr(placement, "split_factor", None)
        if i not in nested and _is_strided(placement) and split_factor is not None:
            # part c of each of split_factor blocks, concatenated (torch's _StridedShard layout)
            indices[d] = torch.cat([_chunk(block, n)[c] for block in _chunk(indices[d], int(split_factor))])
        else:
            indices[d] = _chunk(indices[d], n)[c]
    return indices


def local_part(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """The local tensor this rank holds of the global tensor ``full`` under ``placements`` on ``mesh``."""
    coordinate = mesh.get_coordinate()
    indices = placement_indices(full.shape, placements, coordinate, [mesh.size(d) for d in range(mesh.ndim)])
    out = full
    for dim, index in enumerate(indices):
        if len(index) != full.shape[dim]:
            out = out.index_select(dim, index.to(full.device))
    return out


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


class _SwapTreeIn:
    """Forward pre-hook of a module whose whole subtree swaps its DTensors for local tensors at once."""

    def __init__(self, owners: List[nn.Module]):
        self.owners = owners

    def __call__(self, module: nn.Module, args):
        for owner in self.owners:
            _swap_in_local(owner, args)


class _SwapTreeBack:
    """Forward hook (prepended, always called) that puts back the DTensors :class:`_SwapTreeIn` swapped out."""

    def __init__(self, owners: List[nn.Module]):
        self.owners = owners

    def __call__(self, module: nn.Module, args, output):
        for owner in reversed(self.owners):
            _swap_back(owner, args, output)
        return None


@contextlib.contextmanager
def hoisted_local_views(module: nn.Module):
    """The swap :func:`hoist_local_views` hooks around ``module``'s call, for a call of its forward that bypasses
    its hooks: the recompute of a checkpointed layer (``torch.utils.checkpoint`` runs the forward again during the
    backward, after the hooks have put the DTensors back). The swap is a stack: inside the hooked call it
    pushes nothing new (the subtree holds local tensors already) and pops what it pushed."""
    hooks = [h for h in module._forward_pre_hooks.values() if isinstance(h, _SwapTreeIn)]
    for hook in hooks:
        hook(module, ())
    try:
        yield
    finally:
        for hook in reversed(hooks):
            for owner in reversed(hook.owners):
                _swap_back(owner, (), None)


def hoist_local_views(root: nn.Module) -> int:
    """Swap the DTensors of every module under ``root`` (``root`` included) for their local tensors once,
    around ``root``'s call, instead of around each module's own call; returns how many modules moved.
    ``root`` is marked, so that parameters that become DTensors later (a model compiled before
    ``build``, as ``optimize_model`` does) are hoisted there too.

    For a module compiled on its own (a transformer layer under ``compile_layers``): its hooks run
    outside the compiled code, so the compiled forward sees plain local tensors, while per-module
    hooks inside it would be traced, and each one's distinct ``always_call`` registration is guarded on,
    which makes torch.compile recompile every layer (past its limit, the rest run eagerly). The
    tensors and gradients are the same: ``to_local()`` of the same DTensors, a little earlier.
    """
    root.__dict__[HOIST_ATTR] = True  # also for the DTensors a later build makes (distribute_parameters)
    owners = [m for m in root.modules() if m.__dict__.get(LOCAL_VIEW_ATTR) is not None]
    moved = []
    for owner in owners:
        pre = [key for key, hook in owner._forward_pre_hooks.items() if hook is _swap_in_local]
        post = [key for key, hook in owner._forward_hooks.items() if hook is _swap_back]
        if not pre and not post:
            continue  # hoisted already (root called twice), or never hooked
        for key in pre:
            del owner._forward_pre_hooks[key]
        for key in post:
            del owner._forward_hooks[key]
            owner._forward_hooks_always_called.pop(key, None)
        moved.append(owner)
    if moved:
        root.register_forward_pre_hook(_SwapTreeIn(moved))
        # as the per-module hooks: back before any later hook (FSDP2's reshard), also when the forward raises
        root.register_forward_hook(_SwapTreeBack(moved), prepend=True, always_call=True)
    return len(moved)


def distribute_parameters(model: nn.Module, tp_mesh) -> int:
    """Turn ``model``'s parameters (and sharded buffers) into DTensors on ``tp_mesh``; returns how many.

    Sharding is read from each module's shard records; tied tensors stay tied (one DTensor for all
    holders). Modules owning DTensors get the local-view hooks described in the module docstring.
    """
    from ..module_record import expert_slice_specs
    from .sharding import shard_specs

    done: Dict[int, tuple] = {}  # id(plain tensor) -> (plain tensor, kept alive so ids stay unique; DTensor)
    count = 0
    for module in model.modules():
        specs = shard_specs(module)
        # an expert-parallel slice stays a plain tensor: its data parallelism runs on its own expert mesh, which a
        # DTensor on tp would have to share a root mesh with, and its copies on the tp ranks are summed by its
        # module (see distributed/expert_parallel.py)
        expert_slices = expert_slice_specs(module)
        owns = False
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(store.items()):
                if t is None or (is_param and name in expert_slices):
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
    for module in model.modules():  # layers compiled before the build: their DTensors swap around the layer
        if module.__dict__.get(HOIST_ATTR):
            hoist_local_views(module)
    register_rank_major(model)
    logger.info("%d tensors are DTensors on %s", count, tp_mesh)
    return count

"""Allocating a meta-device model's tensors at their sharded size, each shard equal to the matching slice
of the unsharded model initialized the same way.

Each module is initialized once at full size in a temporary copy and cut, so memory holds at most one
full module at a time. ``schedlang.build`` materializes a model this way; pretrained loading
(:mod:`schedlang.pretrained`) uses it for the tensors a checkpoint does not hold.

Example::

    Materializer(torch.device("cpu"), DEFAULT_INIT, default_inits(model)).run(model)
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Callable, Dict, Optional, Set, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm.auto import tqdm

from .distributed.dtensor_params import is_dtensor
from .distributed.sharding import shard_tensor
from .errors import ScheduleValueError
from .module_record import expert_slice_specs, original_view, shard_specs

__all__ = ["DEFAULT_INIT", "Materializer", "default_inits"]

logger = logging.getLogger("schedlang.build")

#: the init of each module is its own default (``default_inits``): HF ``_init_weights`` or ``reset_parameters``
DEFAULT_INIT = object()


def _is_hf_model(module: nn.Module) -> bool:
    """A transformers PreTrainedModel (without importing transformers): it initializes its submodules itself."""
    return callable(getattr(module, "_init_weights", None)) and hasattr(module, "config") and any(
        k.__name__ == "PreTrainedModel" for k in type(module).__mro__)


def default_inits(root: nn.Module) -> Dict[int, Callable[[nn.Module], None]]:
    """Per module (by id), the function that initializes it: the ``_init_weights`` of the closest enclosing
    HF model, as transformers' ``initialize_weights`` dispatches it, else the module's ``reset_parameters``."""
    inits: Dict[int, Callable[[nn.Module], None]] = {}

    def reset(module: nn.Module) -> None:
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()

    def visit(module: nn.Module, owner) -> None:
        if _is_hf_model(module):
            owner = module._init_weights
        inits.setdefault(id(module), owner or reset)
        for child in module.children():
            visit(child, owner)

    visit(root, None)
    return inits


def _own_tensors(module: nn.Module):
    return [(n, t, n in module._parameters) for n, t in list(module._parameters.items()) + list(module._buffers.items())
            if t is not None]


def _spec(module: nn.Module, name: str):
    """How ``module``'s tensor ``name`` was cut from the unsharded one: a tensor-parallel shard or a rank's slice
    of experts (None: whole)."""
    return shard_specs(module).get(name) or expert_slice_specs(module).get(name)


def _full_shape(module: nn.Module, name: str, tensor: torch.Tensor) -> Tuple[int, ...]:
    spec = _spec(module, name)
    return tuple(spec.full_shape) if spec is not None else tuple(tensor.shape)


def _template(module: nn.Module, make_tensor: Callable, memo: Dict[int, torch.Tensor]) -> nn.Module:
    """A copy of ``module``'s subtree as the unsharded model has it: original classes and attributes (from
    each module's record), full-size tensors made by ``make_tensor(module, name, tensor, is_param)``
    (one per distinct tensor, so tied tensors stay tied). The module itself is not changed."""
    klass, attributes = original_view(module)
    copy_ = klass.__new__(klass)
    copy_.__dict__.update(module.__dict__)
    copy_.__dict__.update(attributes)
    # None entries (a Linear without bias) are kept: inits test `module.bias is not None`
    copy_.__dict__["_parameters"] = {n: None for n, t in module._parameters.items() if t is None}
    copy_.__dict__["_buffers"] = {n: None for n, t in module._buffers.items() if t is None}
    copy_.__dict__["_modules"] = {}
    for name, t, is_param in _own_tensors(module):
        if id(t) not in memo:
            memo[id(t)] = make_tensor(module, name, t, is_param)
        (copy_._parameters if is_param else copy_._buffers)[name] = memo[id(t)]
    for name, child in module._modules.items():
        copy_._modules[name] = None if child is None else _template(child, make_tensor, memo)
    return copy_


def _new_tensor(shape, like: torch.Tensor, is_param: bool, device) -> torch.Tensor:
    data = torch.empty(shape, dtype=like.dtype, device=device)
    return nn.Parameter(data, requires_grad=like.requires_grad) if is_param else data


def _cut(module: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    spec = _spec(module, name)
    if spec is None:
        return full.detach()
    return shard_tensor(full, spec.axis, spec.rank, spec.world_size, getattr(spec, "groups", 1),
                        getattr(spec, "blocks", None))


class Materializer:
    """Allocates a meta-device model's tensors at their sharded size, module by module, children first.

    Each module's init runs on a temporary full-size copy (so it sees the shapes, classes and
    attributes of the unsharded module and draws the same random numbers in the same order), and
    each rank keeps its shard of the result. An init may also write its descendants' tensors
    (GPT-2's attention re-initializes ``c_proj``): a dry run on meta tensors finds which, and those
    are re-cut into the descendants' shards. Tied tensors are materialized once and stay tied.
    """

    def __init__(self, device, init: Optional[Callable[[nn.Module], None]], inits: Dict[int, Callable],
                 keep: Optional[Set[int]] = None, dtype: Optional[torch.dtype] = None):
        self.device = device
        self.dtype = dtype  # floating-point tensors are cast to it once initialized, as model.to(dtype) would
        self.init = init
        self.inits = inits
        # ids of the meta tensors to allocate (None: all). The others stay meta, but their modules' inits still run
        # on the temporary full-size copies, so the random numbers drawn, and the kept tensors' values, are those
        # of a build that allocates everything (a pipeline rank keeps its own stages only)
        self.keep = keep
        self.done: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta tensor) -> (meta tensor, new tensor)

    def run(self, root: nn.Module) -> None:
        needs = {id(m) for m in root.modules() if any(t.is_meta for _, t, _ in _own_tensors(m))}
        # modules with a meta tensor somewhere below them; their init may have something to write
        order = list(_post_order(root))
        has_meta_below: Dict[int, bool] = {}
        for m in order:
            has_meta_below[id(m)] = id(m) in needs or any(has_meta_below.get(id(c), False)
                                                           for c in m.children())
        for m in tqdm(order, desc="materializing", disable=not _show_progress(len(order)), leave=False):
            if has_meta_below[id(m)]:
                self._materialize(m)

    def _init_fn(self, module: nn.Module):
        if self.init is None:
            return None
        return self.init if self.init is not DEFAULT_INIT else self.inits.get(id(module))

    def _materialize(self, module: nn.Module) -> None:
        pending = []
        for name, t, is_param in _own_tensors(module):
            if not t.is_meta:
                continue
            if id(t) in self.done:  # tied: materialized with its other holder
                (module._parameters if is_param else module._buffers)[name] = self.done[id(t)][1]
            else:
                pending.append((name, t, is_param))
        init = self._init_fn(module)
        if init is None:
            for name, t, is_param in pending:
                if self._kept(t):
                    self._store(module, name, t, is_param, _new_tensor(_local_shape(t), t, is_param, self.device))
            return
        written_below = self._dry_run(module, init) if module._modules else set()
        if not pending and not written_below:
            return
        own_ids = {id(t) for _, t, _ in pending}

        def make(owner, name, t, is_param):
            shape = _full_shape(owner, name, t)
            if id(t) in own_ids:
                return _new_tensor(shape, t, is_param, self.device)
            if id(t) in written_below:
                return _new_tensor(shape, t, is_param, self.device)
            return _new_tensor(shape, t, is_param, "meta")  # not touched: a placeholder of the right shape

        memo: Dict[int, torch.Tensor] = {}
        template = _template(module, make, memo)
        versions = {i: memo[i]._version for i in own_ids}
        # which elements of the descendants' tensors the init writes: a whole tensor can be re-cut into shards
        written = _WrittenElements([memo[i] for i in written_below]) if written_below else contextlib.nullcontext()
        with torch.no_grad(), written:
            init(template)
        for name, t, is_param in pending:
            full = memo[id(t)]
            if full._version == versions[id(t)]:
                logger.warning("%s: %s's init did not set '%s'; it is initialized to zeros", type(module).__name__,
                               type(module).__name__, name)
                with torch.no_grad():
                    full.zero_()
            if self._kept(t):
                self._store(module, name, t, is_param, _cut(module, name, full))
        if written_below:
            self._recut_descendants(module, memo, written_below, written)

    def _dry_run(self, module: nn.Module, init) -> set:
        """ids of the tensors *below* ``module`` that its init writes (found on meta copies)."""
        memo: Dict[int, torch.Tensor] = {}
        template = _template(module, lambda owner, name, t, is_param: _new_tensor(
            _full_shape(owner, name, t), t, is_param, "meta"), memo)
        before = {i: m._version for i, m in memo.items()}
        try:
            with torch.no_grad():
                init(template)
        except Exception as e:  # an init that cannot run on meta tensors: assume it writes only its own
            logger.debug("%s: dry run of the init failed (%s); assuming it writes only its own tensors",
                         type(module).__name__, e)
            return set()
        own = {id(t) for _, t, _ in _own_tensors(module)}
        return {i for i, m in memo.items() if m._version != before[i] and i not in own}

    def _recut_descendants(self, module: nn.Module, memo, written: set, elements: "_WrittenElements") -> None:
        for path, sub in module.named_modules():
            if sub is module:
                continue
            for name, t, is_param in _own_tensors(sub):
                if id(t) not in written:
                    continue
                if t.is_meta:  # a tensor this build does not keep (and so not allocated)
                    written = written - {id(t)}
                    continue
                full = memo[id(t)]
                if not elements.whole(full):
                    raise ScheduleValueError(
                        f"build: the init of {type(module).__name__} writes only part of '{path}.{name}' (a tensor of "
                        "one of its submodules), which cannot be rebuilt from a shard; initialize that tensor in the "
                        "submodule's own init, or build the model with real weights")
                with torch.no_grad():
                    t.copy_(_cut(sub, name, full))
                written = written - {id(t)}

    def _kept(self, t: torch.Tensor) -> bool:
        return self.keep is None or id(t) in self.keep

    def _store(self, module: nn.Module, name: str, old: torch.Tensor, is_param: bool, value: torch.Tensor) -> None:
        value = value.contiguous()
        if self.dtype is not None and value.is_floating_point():
            value = value.to(self.dtype)
        if is_dtensor(old):  # a tensor-parallel shard already made a DTensor: the new one keeps its mesh and layout
            from torch.distributed.tensor import DTensor

            value = DTensor.from_local(value, old.device_mesh, old.placements, run_check=False, shape=old.shape,
                                       stride=old.stride())
        if is_param:
            new = nn.Parameter(value.detach(), requires_grad=old.requires_grad)
            for key, attribute in vars(old).items():  # annotations (schedlang's annotate) travel with the parameter
                if not key.startswith("_"):
                    setattr(new, key, attribute)
            module._parameters[name] = new
        else:
            new = value
            module._buffers[name] = new
        self.done[id(old)] = (old, new)

    def repoint(self, root: nn.Module) -> int:
        """Put the new tensors in ``root`` wherever it still holds a meta tensor this build allocated (a module
        that registered the same tensor under a path of its own, as a pipeline stage does for tensors no stage's
        code uses); returns how many."""
        count = 0
        for module in root.modules():
            for store in (module._parameters, module._buffers):
                for name, t in list(store.items()):
                    if t is not None and id(t) in self.done and self.done[id(t)][0] is t:
                        store[name] = self.done[id(t)][1]
                        count += 1
        return count


def _local_shape(t: torch.Tensor) -> Tuple[int, ...]:
    """The shape of the tensor a rank holds: a DTensor's local shard, else the tensor's own."""
    if is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        return tuple(compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[0])
    return tuple(t.shape)


class _WrittenElements(TorchDispatchMode):
    """While active, records which elements of the given tensors are written (by any in-place or ``out=``
    operation on the tensor or on a view of it): an explicit record of what an init initialized."""

    def __init__(self, tensors):
        super().__init__()
        self.tensors = {t.untyped_storage().data_ptr(): t for t in tensors if t.numel()}
        self.masks = {key: torch.zeros(t.shape, dtype=torch.bool, device=t.device) for key, t in self.tensors.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = kwargs[argument.name] if argument.name in kwargs else (args[i] if i < len(args) else None)
            for target in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(target, torch.Tensor):
                    self._mark(target)
        return out

    def _mark(self, target: torch.Tensor) -> None:
        key = target.untyped_storage().data_ptr()
        base = self.tensors.get(key)
        if base is None:
            return
        with torch.no_grad():
            # the written view, laid over the (contiguous) tensor it belongs to
            self.masks[key].as_strided(target.shape, target.stride(),
                                       target.storage_offset() - base.storage_offset()).fill_(True)

    def whole(self, tensor: torch.Tensor) -> bool:
        """Whether every element of ``tensor`` (one of those given) was written."""
        mask = self.masks.get(tensor.untyped_storage().data_ptr())
        return mask is None or bool(mask.all())


def _post_order(root: nn.Module):
    seen = set()

    def visit(m):
        if id(m) in seen:
            return
        seen.add(id(m))
        for c in m.children():
            yield from visit(c)
        yield m

    yield from visit(root)


def _show_progress(n: int) -> bool:
    return n > 200 and sys.stderr.isatty()

"""``schedlang.build``: turn a schedule into a model ready to train, and its optimizer.

For a model with real weights the working copy is already the scheduled model: build
moves it to ``device`` / ``dtype`` and makes the optimizer. For a model on the meta device
(:func:`schedlang.init_empty_weights`) build allocates every tensor at its *sharded*
size and initializes it so that each shard equals the matching slice of the unsharded
model initialized the same way with the same seed: each module is initialized once at
full size in a temporary copy and cut, so memory holds at most one full module at a time.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm.auto import tqdm

from .distributed.agreement import agreement, check_same_plan
from .distributed.groups import default_device
from .distributed.sharding import shard_tensor
from .errors import ArgumentTypeError, SchedlangError, ScheduleTypeError, ScheduleValueError
from .init import has_meta_tensors
from .module_record import original_view, shard_specs

__all__ = ["build"]

logger = logging.getLogger("schedlang.build")


def _is_hf_model(module: nn.Module) -> bool:
    """A transformers PreTrainedModel (without importing transformers): it initializes its submodules itself."""
    return callable(getattr(module, "_init_weights", None)) and hasattr(module, "config") and any(
        k.__name__ == "PreTrainedModel" for k in type(module).__mro__)


def _default_inits(root: nn.Module) -> Dict[int, Callable[[nn.Module], None]]:
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


def _full_shape(module: nn.Module, name: str, tensor: torch.Tensor) -> Tuple[int, ...]:
    spec = shard_specs(module).get(name)
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
    spec = shard_specs(module).get(name)
    if spec is None:
        return full.detach()
    return shard_tensor(full, spec.axis, spec.rank, spec.world_size, getattr(spec, "groups", 1),
                        getattr(spec, "blocks", None))


class _Materializer:
    """Allocates a meta-device model's tensors at their sharded size, module by module, children first.

    Each module's init runs on a temporary full-size copy (so it sees the shapes, classes and
    attributes of the unsharded module and draws the same random numbers in the same order), and
    each rank keeps its shard of the result. An init may also write its descendants' tensors
    (GPT-2's attention re-initializes ``c_proj``): a dry run on meta tensors finds which, and those
    are re-cut into the descendants' shards. Tied tensors are materialized once and stay tied.
    """

    def __init__(self, device, init: Optional[Callable[[nn.Module], None]], inits: Dict[int, Callable]):
        self.device = device
        self.init = init
        self.inits = inits
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
        return self.init if self.init is not _DEFAULT else self.inits.get(id(module))

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
                shape = tuple(t.shape)
                self._store(module, name, t, is_param, _new_tensor(shape, t, is_param, self.device))
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
                full = memo[id(t)]
                if not elements.whole(full):
                    raise ScheduleValueError(
                        f"build: the init of {type(module).__name__} writes only part of '{path}.{name}' (a tensor of "
                        "one of its submodules), which cannot be rebuilt from a shard; initialize that tensor in the "
                        "submodule's own init, or build the model with real weights")
                with torch.no_grad():
                    t.copy_(_cut(sub, name, full))
                written = written - {id(t)}

    def _store(self, module: nn.Module, name: str, old: torch.Tensor, is_param: bool, value: torch.Tensor) -> None:
        if is_param:
            new = nn.Parameter(value.detach().contiguous(), requires_grad=old.requires_grad)
            module._parameters[name] = new
        else:
            new = value.contiguous()
            module._buffers[name] = new
        self.done[id(old)] = (old, new)


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


_DEFAULT = object()


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
    import sys

    return n > 200 and sys.stderr.isatty()


def _model_device(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def _parallelize(root, model: nn.Module, pipeline: Optional[Dict[str, Any]],
                 master_weights: Optional[torch.dtype] = None) -> nn.Module:
    """Tensor-parallel DTensors, pipeline stages and data parallelism, in that order (see :func:`build`).
    ``master_weights``: the compute dtype of an optimizer with fp32 masters (``replicate`` runs on DDP)."""
    from .distributed import mesh as meshes
    from .distributed.data_parallel import apply_data_parallel, data_parallel_steps
    from .distributed.groups import SingleRankGroup, is_distributed

    mesh = root.mesh
    device = _model_device(model)
    cuts = [s.path for s in root.plan if s.primitive == "cut_pipeline_stage"]
    if pipeline is not None and not cuts:
        raise ScheduleValueError("build: pipeline= was given but the plan cuts no pipeline stage; mark the "
                                 "boundaries with sch[path].cut_pipeline_stage()")
    if cuts and pipeline is None:
        raise ScheduleValueError(f"build: the plan cuts pipeline stages after {', '.join(cuts)}; pass "
                                 "pipeline={'schedule': '1F1B', 'n_microbatches': N, 'loss_fn': fn} to run them")
    # DTensors need a live process group (tests that only pretend to be a rank have none)
    if root.world_size > 1 and is_distributed() and any(s.primitive == "shard" for s in root.plan):
        tp_mesh = meshes.tensor_parallel_mesh(mesh) if mesh is not None else meshes.mesh_from_group(
            root.group, device.type)
        from .distributed.dtensor_params import distribute_parameters

        distribute_parameters(model, tp_mesh)
    dp_steps = data_parallel_steps(root.plan)
    dp_mesh = meshes.data_parallel_mesh(mesh)
    if dp_steps and dp_mesh is None:
        if is_distributed() and not isinstance(root.group, SingleRankGroup):
            raise ScheduleValueError("build: the plan has data-parallel steps but the schedule has no mesh with a "
                                     "data-parallel dimension; create the schedule with a mesh that has a 'dp' (or "
                                     "'dp_replicate' and 'dp_shard') dimension, or drop the fully_shard / replicate "
                                     "steps")
        logger.info("single process: the plan's fully_shard / replicate steps have nothing to shard over; skipped")
        dp_steps = []
    if cuts:
        from .distributed.pipeline import build_pipeline

        pp = meshes.pipeline_mesh(mesh) if mesh is not None else None
        if pp is None:
            import torch.distributed as dist

            if not is_distributed():
                raise ScheduleValueError("build: pipeline stages need torch.distributed (one rank per stage group); "
                                         "run under torchrun")
            pp = dist.group.WORLD

        def prepare_stage(stage: nn.Module) -> None:
            if dp_steps:
                apply_data_parallel(stage, dp_steps, dp_mesh, device, missing_ok=True, master_weights=master_weights)

        return build_pipeline(model, cuts, pp, pipeline, device, prepare_stage)
    if dp_steps:
        apply_data_parallel(model, dp_steps, dp_mesh, device, master_weights=master_weights)
    return model


def _agreement_group(root):
    """The ranks that build this schedule together: the mesh's, else the schedule's group (None: the world)."""
    return root.mesh if root.mesh is not None else root.group


def _check_device(device) -> Optional[torch.device]:
    if device is None:
        return None
    if not isinstance(device, (str, torch.device, int)) or isinstance(device, bool):
        raise ScheduleTypeError(f"build: device must be a string such as 'cpu' or 'cuda:0', a torch.device or a "
                                f"GPU index, got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ScheduleValueError(f"build: device {device!r} is not a device: valid are 'cpu', 'cuda', 'cuda:N', "
                                 "'meta' or a torch.device") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ScheduleValueError(f"build: device {device!r} asks for CUDA, but no CUDA device is available; "
                                     "use device='cpu'")
        if dev.index is not None and dev.index >= count:
            raise ScheduleValueError(f"build: device {device!r} does not exist: valid CUDA indices are 0..{count - 1}")
    elif dev.type not in ("cpu", "meta"):
        backend = getattr(torch, dev.type, None)
        if backend is None or not callable(getattr(backend, "is_available", None)) or not backend.is_available():
            raise ScheduleValueError(f"build: device {device!r} is not available here: use 'cpu'"
                                     + (" or 'cuda'" if torch.cuda.is_available() else ""))
    return dev


def _check_dtype(dtype) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise ScheduleTypeError(f"build: dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    if not (dtype.is_floating_point or dtype.is_complex):
        raise ScheduleValueError(f"build: dtype {dtype} is not a floating-point dtype; pass one of "
                                 "torch.float32, torch.bfloat16, torch.float16 or torch.float64")


def _make_optimizer(optimizer, params, optimizer_kwargs):
    if isinstance(optimizer, str):
        from .optim import make_optimizer

        return make_optimizer(optimizer, params, **optimizer_kwargs)
    return optimizer(params, **optimizer_kwargs)


def _check_optimizer(optimizer, optimizer_kwargs, device: torch.device, dtypes) -> None:
    """Make the optimizer over stand-in parameters (one per dtype the model's will have), so that a bad name,
    option or dtype fails before the model changes."""
    if optimizer is None:
        if optimizer_kwargs:
            raise ScheduleValueError(f"build: optimizer options {sorted(optimizer_kwargs)} given without optimizer=")
        return
    if isinstance(optimizer, str):
        from .optim import OPTIMIZERS

        if optimizer.lower() not in OPTIMIZERS:
            raise ScheduleValueError(f"build: unknown optimizer {optimizer!r}: valid names are "
                                     f"{', '.join(repr(n) for n in OPTIMIZERS)}, or pass a torch.optim.Optimizer class")
    elif not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise ScheduleTypeError(f"build: optimizer must be a name ('adamw', 'adam', 'sgd') or a "
                                f"torch.optim.Optimizer class, got {optimizer!r}")
    where = "cpu" if device.type == "meta" else device
    stand_ins = [nn.Parameter(torch.zeros(1, device=where, dtype=d)) for d in dtypes]
    name = optimizer if isinstance(optimizer, str) else optimizer.__name__
    try:
        _make_optimizer(optimizer, stand_ins, optimizer_kwargs)
    except SchedlangError as e:
        raise type(e)(f"build: optimizer {name!r} rejects its options {optimizer_kwargs}: {e}") from e
    except (TypeError, ValueError) as e:
        kind = ScheduleTypeError if isinstance(e, TypeError) else ScheduleValueError
        raise kind(f"build: optimizer {name!r} rejects its options {optimizer_kwargs}: {e}") from e


def _check_master_weights(master_weights, optimizer, root, compute_dtype) -> None:
    """``master_weights=True`` needs one of schedlang's fused Adams, which keep the fp32 masters, and a layout
    that keeps the parameters plain tensors: data parallelism by ``replicate`` (DDP), no tensor parallelism."""
    if not isinstance(master_weights, bool):
        raise ScheduleTypeError(f"build: master_weights must be True or False, got {master_weights!r}")
    if not master_weights:
        return
    from .optim import FusedAdam

    fused_adam = (optimizer.lower() in ("adam", "adamw") if isinstance(optimizer, str)
                  else isinstance(optimizer, type) and issubclass(optimizer, FusedAdam))
    if not fused_adam:
        raise ScheduleValueError(f"build: master_weights=True needs optimizer='adamw' or 'adam' (schedlang's fused "
                                 f"Adam keeps the fp32 masters), got optimizer={optimizer!r}")
    if root.world_size > 1 and any(s.primitive == "shard" for s in root.plan):
        shard = next(s for s in root.plan if s.primitive == "shard")
        raise ScheduleValueError(
            f"build: master_weights=True keeps plain parameters, but the plan shards '{shard.path}' over "
            f"{root.world_size} tensor-parallel ranks (its parameters become DTensors, which the fused Adam keeps no "
            "masters for); use master_weights=False with tensor parallelism")
    from .distributed import mesh as meshes
    from .distributed.data_parallel import check_master_weights_layout, data_parallel_steps

    steps = data_parallel_steps(root.plan)
    if steps:
        check_master_weights_layout(steps, meshes.data_parallel_mesh(root.mesh) if root.mesh is not None else None,
                                    compute_dtype)


def _check_arguments(model: nn.Module, init_weights, optimizer, optimizer_kwargs, device, dtype) -> torch.device:
    """Every check of build's arguments, before anything is cast, moved or initialized; returns the device
    meta tensors are materialized on."""
    if init_weights not in (None, True, False) and not callable(init_weights):
        raise ScheduleTypeError(f"build: init_weights must be None, a bool or a callable fn(module), got "
                                f"{init_weights!r}")
    dev = _check_device(device)
    _check_dtype(dtype)
    target = dev if dev is not None else (default_device() if has_meta_tensors(model) else _model_device(model))
    if dev is None and target.type == "meta":
        target = torch.device("cpu")
    trained = [p for p in model.parameters() if p.requires_grad]
    dtypes = [dtype] if dtype is not None and trained else sorted({p.dtype for p in trained}, key=str)
    _check_optimizer(optimizer, optimizer_kwargs, target, dtypes or [torch.float32])
    return target


def build(sch, init_weights: Union[None, bool, Callable[[nn.Module], None]] = None, optimizer: Any = None,
          device: Union[None, str, torch.device] = None, dtype: Optional[torch.dtype] = None,
          pipeline: Optional[Dict[str, Any]] = None, pretrained: Any = None,
          **optimizer_kwargs: Any) -> Tuple[nn.Module, Optional[torch.optim.Optimizer]]:
    """Materialize the schedule's model; returns ``(model, optimizer)``.

    Arguments:
        sch: the schedule (any view; the whole model is built).
        init_weights: for tensors on the meta device: None/True initializes them with each module's
            ``reset_parameters`` (or a HF model's ``_init_weights``), a callable ``fn(module)`` with that,
            False leaves them uninitialized (to load a checkpoint into). On a model with real weights
            a callable is applied to every module; otherwise weights are kept.
        optimizer: None, a name (``"adamw"``, ``"adam"``, ``"sgd"``: schedlang's fused Triton
            optimizers) or an optimizer class such as ``torch.optim.AdamW``.
        device, dtype: where and in which dtype the model ends up.
        pipeline: with ``cut_pipeline_stage`` steps in the plan, how to run the stages on the mesh's
            ``pp`` dimension: ``{"schedule": "1F1B" | "GPipe" | "Interleaved1F1B" | "ZeroBubble",
            "n_microbatches": N, "loss_fn": fn(output, target)}``; the model returned is then a
            :class:`~schedlang.distributed.pipeline.PipelinedModel` holding this rank's stages, trained
            with ``model.step(inputs, target=..., losses=[])``.
        pretrained: a HF safetensors checkpoint (a directory, a ``.safetensors`` file or a list of
            them) to load the weights from; each rank reads only the slices it holds and the tensors
            it loads are never initialized (see :mod:`schedlang.pretrained`). Names and shapes are
            checked before anything is allocated.
        **optimizer_kwargs: passed to the optimizer (``lr=...``). ``master_weights=True`` (with ``"adamw"`` /
            ``"adam"``) gives the Linear weights fp32 master weights in the optimizer and bf16 (``compute_dtype``)
            parameters in the model (:func:`schedlang.optim.master_weight_groups`): autocast's numbers without
            its weight and gradient casts. The parameters must stay plain tensors: no tensor parallelism
            and no ``fully_shard``; ``replicate`` then runs on DDP, all-reducing gradient buckets during the
            backward in the ``mp_policy``'s ``reduce_dtype`` (fp32 by default; see
            :mod:`schedlang.distributed.data_parallel`). Slapo's ``target="deepspeed"`` (and any
            target registered in :mod:`schedlang.framework_dialect`) hands the built model to that
            framework's engine instead.

    The layers of a parallel model, in the order they are put on:

    1. tensor parallelism: with a ``tp`` dimension (or group) of more than one rank, every parameter
       becomes a DTensor on it (see :mod:`schedlang.distributed.dtensor_params`);
    2. pipeline stages (``cut_pipeline_stage`` + ``pipeline=``), each rank keeping its own stages;
    3. data parallelism (``fully_shard`` / ``replicate`` steps) on the data dimensions, inner modules
       first, within each stage;
    4. the optimizer, over this rank's parameters.

    Example::

        model, opt = schedlang.build(sch, optimizer="adamw", lr=1e-4)
    """
    from .schedule import Schedule

    if not isinstance(sch, Schedule):  # a bare model has no plan to materialize
        raise ArgumentTypeError(f"build: sch must be a schedlang.Schedule, got {type(sch).__name__}; wrap the model "
                                f"first: sch = schedlang.create_schedule(model)")
    target_framework = optimizer_kwargs.pop("target", None)
    if target_framework not in (None, "schedlang", "torch", "native"):
        from .framework_dialect import build_with_target

        given = {k: v for k, v in (("optimizer", optimizer), ("device", device), ("dtype", dtype),
                                   ("pipeline", pipeline), ("pretrained", pretrained)) if v is not None}
        built = build_with_target(sch, target_framework, init_weights=init_weights, **given, **optimizer_kwargs)
        sch.root._state.built = True
        return built
    master_weights = optimizer_kwargs.pop("master_weights", False)
    root = sch.root
    model: nn.Module = root.mod
    group = _agreement_group(root)
    # every phase ends in an agreement: a rank that fails makes every rank fail within seconds (naming
    # it), instead of leaving the others blocked in the next collective
    with agreement(group, phase="build: checking the arguments"):
        _check_master_weights(master_weights, optimizer, root, optimizer_kwargs.get("compute_dtype", torch.bfloat16))
        target = _check_arguments(model, init_weights, optimizer, optimizer_kwargs, device, dtype)
        weights = None
        if pretrained is not None:
            from .pretrained import PretrainedWeights

            weights = PretrainedWeights.for_build(model, pretrained, init_weights, dtype)
    # before any collective of the plan runs: ranks with different plans would pair up different collectives
    check_same_plan(root.plan, group, phase="build: plan comparison")
    with agreement(group, phase="build: initializing the weights"):
        if has_meta_tensors(model):
            init = None if init_weights is False else (init_weights if callable(init_weights) else _DEFAULT)
            if weights is not None:
                weights.materialize(model, target)
            else:
                _Materializer(target, init, _default_inits(model) if init is _DEFAULT else {}).run(model)
            logger.info("materialized meta tensors on %s", target)
        elif callable(init_weights) and weights is None:
            with torch.no_grad():
                model.apply(init_weights)
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        from .primitives.annotate import apply_annotations

        for module in model.modules():
            apply_annotations(module)
    with agreement(group, phase="build: tensor, pipeline and data parallelism"):
        compute_dtype = optimizer_kwargs.get("compute_dtype", torch.bfloat16) if master_weights else None
        model = _parallelize(root, model, pipeline, master_weights=compute_dtype)
        from .distributed.dtensor_params import register_rank_major

        register_rank_major(model)  # FSDP2 replaced parameters: full_tensor still knows the rank-major ones
    opt = None
    with agreement(group, phase="build: loading the weights and making the optimizer"):
        if weights is not None:
            weights.load(model)
        if optimizer is not None:
            if master_weights:
                from .optim import master_weight_groups

                # the Linear weights only: embeddings, norms and biases stay fp32, as autocast computes them
                params = master_weight_groups(model, **({"compute_dtype": optimizer_kwargs["compute_dtype"]}
                                                        if "compute_dtype" in optimizer_kwargs else {}))
            else:
                params = [p for p in model.parameters() if p.requires_grad]
            opt = _make_optimizer(optimizer, params, optimizer_kwargs)
            from .distributed.float8_fsdp import precompute_scales_after_step

            # float8 all-gather under FSDP2: every weight's scale from one all-reduce after each step
            precompute_scales_after_step(model, opt)
        else:
            _say_float8_scales_need_a_hook(model)
    root._state.built = True
    return model, opt


def _say_float8_scales_need_a_hook(model: nn.Module) -> None:
    """A model with float8 all-gathered weights and no optimizer made here: the caller's optimizer needs the
    hook that stores the scales after each step, or every all-gather all-reduces each weight's amax itself."""
    from .distributed.float8_fsdp import float8_all_gather_linears

    count = len(float8_all_gather_linears(model))
    if count:
        logger.warning("build: %d float8 all-gathered weight(s) and no optimizer made here: after making yours, call "
                       "schedlang.distributed.float8_fsdp.precompute_scales_after_step(model, optimizer), or each "
                       "all-gather all-reduces its own weight's amax (a small collective per Linear per step)", count)

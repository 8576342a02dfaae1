"""``schedlang.build``: turn a schedule into a model ready to train, and its optimizer.

For a model with real weights the working copy is already the scheduled model: build
moves it to ``device`` / ``dtype`` and makes the optimizer. For a model on the meta device
(:func:`schedlang.init_empty_weights`) build allocates every tensor at its *sharded*
size and initializes it so that each shard equals the matching slice of the unsharded
model initialized the same way with the same seed (:mod:`schedlang.materialize`). Under a
pipeline a rank allocates the tensors of its own stages only, once the split is known; the
other stages stay on the meta device.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import nn

from .argument_checks import check_device
from .distributed.agreement import agreement, check_same_plan
from .distributed.groups import default_device
from .errors import ArgumentTypeError, SchedlangError, ScheduleTypeError, ScheduleValueError
from .init import has_meta_tensors
from .materialize import DEFAULT_INIT, Materializer, default_inits

__all__ = ["build", "register_target_builder", "NATIVE_TARGETS"]

logger = logging.getLogger("schedlang.build")


def _model_device(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def _parallelize(root, model: nn.Module, pipeline: Optional[Dict[str, Any]],
                 master_weights: Optional[torch.dtype] = None, by_stage: Optional[Materializer] = None) -> nn.Module:
    """Tensor-parallel DTensors, pipeline stages and data parallelism, in that order (see :func:`build`).
    ``master_weights``: the compute dtype of an optimizer with fp32 masters (``replicate`` runs on DDP).
    ``by_stage``: the materializer of a model still on the meta device, run once the pipeline's split is known."""
    from .distributed import mesh as meshes
    from .distributed.data_parallel import apply_data_parallel, data_parallel_steps
    from .distributed.groups import SingleRankGroup, is_distributed

    mesh = root.mesh
    device = by_stage.device if by_stage is not None else _model_device(model)
    cuts = [s.path for s in root.plan if s.primitive == "cut_pipeline_stage"]
    if pipeline is not None and not cuts:
        raise ScheduleValueError("build: pipeline= was given but the plan cuts no pipeline stage; mark the "
                                 "boundaries with sch[path].cut_pipeline_stage()")
    if cuts and pipeline is None:
        raise ScheduleValueError(f"build: the plan cuts pipeline stages after {', '.join(cuts)}; pass "
                                 "pipeline={'schedule': '1F1B', 'n_microbatches': N, 'loss_fn': fn} to run them")
    # sharded parameters are DTensors when the schedule has a mesh, and stay plain local shards without one
    # (Slapo's model: a process group, or the world): see "Where a shard lives" in ARCHITECTURE.md. DTensors
    # also need a live process group (tests that only pretend to be a rank have none)
    if (mesh is not None and root.world_size > 1 and is_distributed()
            and any(s.primitive == "shard" for s in root.plan)):
        from .distributed.dtensor_params import distribute_parameters

        distribute_parameters(model, meshes.tensor_parallel_mesh(mesh))
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
    context_parallel = any(s.primitive == "context_parallel" for s in root.plan)
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
            elif context_parallel:  # each stage's gradients averaged over the cp ranks of its pp coordinate
                from .distributed.context_parallel import average_gradients_over, group_of

                average_gradients_over(stage, group_of(model))

        return build_pipeline(model, cuts, pp, pipeline, device, prepare_stage,
                              allocate=None if by_stage is None else functools.partial(_allocate_stages, by_stage, model))
    if dp_steps:
        apply_data_parallel(model, dp_steps, dp_mesh, device, master_weights=master_weights)
    elif context_parallel:
        from .distributed.context_parallel import average_gradients_over, group_of

        # no data parallelism averages what each cp rank's tokens contributed to the gradients: a hook does
        average_gradients_over(model, group_of(model))
    return model


def _move_real_tensors(model: nn.Module, device, dtype: Optional[torch.dtype]) -> None:
    """``model.to(device=device, dtype=dtype)`` for the tensors that are not on the meta device (dtype for the
    floating-point ones), leaving the meta tensors as they are; tied tensors stay tied."""
    if device is None and dtype is None:
        return
    moved: Dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(store.items()):
                if t is None or t.is_meta:
                    continue
                if id(t) not in moved:
                    new = t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else None)
                    if is_param and new is not t:
                        new = nn.Parameter(new.detach(), requires_grad=t.requires_grad)
                    moved[id(t)] = new
                store[name] = moved[id(t)]


def _allocate_stages(materializer: Materializer, model: nn.Module, stages) -> Dict[int, torch.Tensor]:
    """Allocate the tensors of a pipeline rank's ``stages`` (modules of ``model``'s, split from it), and leave the
    other stages' on the meta device; every module's init still runs, so the values are those of a whole build."""
    materializer.keep = {id(t) for stage in stages for t in list(stage.parameters()) + list(stage.buffers())}
    materializer.run(model)
    for stage in stages:  # a stage may hold a tensor under a path of its own (one no stage's code uses)
        materializer.repoint(stage)
    logger.info("materialized the meta tensors of this rank's %d pipeline stage(s) on %s", len(stages),
                materializer.device)
    return {key: new for key, (_, new) in materializer.done.items()}


def _already_there(model: nn.Module, device, dtype: Optional[torch.dtype]) -> bool:
    """Every tensor of ``model`` already on ``device`` with ``dtype`` (floating-point ones): ``model.to`` would
    change nothing. Then it is not called: on fake tensors (a traced build) it would swap every parameter, which
    fails for those a shard index holds a weak reference to."""
    want = torch.device(device) if device is not None else None
    index = want.index if want is not None else None
    if want is not None and index is None and want.type == "cuda":
        return False  # the current device decides: leave it to model.to
    for t in list(model.parameters()) + list(model.buffers()):
        if want is not None and (t.device.type != want.type or (index is not None and t.device.index != index)):
            return False
        if dtype is not None and (t.is_floating_point() or t.is_complex()) and t.dtype != dtype:
            return False
    return True


def _agreement_group(root):
    """The ranks that build this schedule together: the mesh's, else the schedule's group (None: the world)."""
    return root.mesh if root.mesh is not None else root.group


def _check_device(device) -> Optional[torch.device]:
    dev = check_device("build", device, also_valid=", 'meta'")
    if dev is not None and dev.type not in ("cpu", "meta", "cuda"):
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
    if root.mesh is not None and root.world_size > 1 and any(s.primitive == "shard" for s in root.plan):
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


#: ``target=`` values that mean schedlang's own runtime
NATIVE_TARGETS = (None, "schedlang", "torch", "native")
#: the builder of every other ``target=`` (another framework's engine, Slapo's ``target="deepspeed"``):
#: :mod:`schedlang.framework_dialect`, a layer above this one, registers it when imported (``import schedlang`` does)
_TARGET_BUILDER: Dict[str, Callable[..., Any]] = {}


def register_target_builder(builder: Callable[..., Any]) -> None:
    """Make ``builder(sch, target, init_weights=..., **kwargs)`` build every ``target=`` outside ``NATIVE_TARGETS``."""
    _TARGET_BUILDER["builder"] = builder


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

    1. tensor parallelism: with a mesh whose ``tp`` dimension has more than one rank, every parameter
       becomes a DTensor on it (see :mod:`schedlang.distributed.dtensor_params`); a schedule made with a
       process group (or the world) and no mesh keeps its sharded parameters plain local shards, as Slapo
       does (their record, ``shard_specs(module)``, says where each belongs);
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
    if target_framework not in NATIVE_TARGETS:
        build_with_target = _TARGET_BUILDER.get("builder")
        if build_with_target is None:  # pragma: no cover  (``import schedlang`` registers the framework dialects)
            raise ScheduleValueError(f"build: target {target_framework!r} needs schedlang.framework_dialect; import it "
                                     "first (import schedlang.framework_dialect)")
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
    by_stage = None  # a pipeline rank's materializer: it allocates the rank's stages once the split is known
    with agreement(group, phase="build: initializing the weights"):
        if has_meta_tensors(model):
            init = None if init_weights is False else (init_weights if callable(init_weights) else DEFAULT_INIT)
            materializer = (weights.materializer(model, target) if weights is not None else
                            Materializer(target, init, default_inits(model) if init is DEFAULT_INIT else {}))
            if pipeline is not None and any(s.primitive == "cut_pipeline_stage" for s in root.plan):
                # allocating the whole model first would put every stage on every pp rank (LLaMA-3.1-405B at tp 8:
                # 202 GB a rank in fp32) before the split keeps one of them
                by_stage = materializer
                by_stage.dtype = dtype
                # what the model made for real (transformers' rotary frequencies) goes where the rest will be
                _move_real_tensors(model, device, dtype)
            else:
                materializer.run(model)
                logger.info("materialized meta tensors on %s", target)
        elif callable(init_weights) and weights is None:
            with torch.no_grad():
                model.apply(init_weights)
        if by_stage is None and (device is not None or dtype is not None) and not _already_there(model, device,
                                                                                                  dtype):
            model.to(device=device, dtype=dtype)
        from .primitives.annotate import apply_annotations

        for module in model.modules():
            apply_annotations(module)
    with agreement(group, phase="build: tensor, pipeline and data parallelism"):
        compute_dtype = optimizer_kwargs.get("compute_dtype", torch.bfloat16) if master_weights else None
        model = _parallelize(root, model, pipeline, master_weights=compute_dtype, by_stage=by_stage)
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

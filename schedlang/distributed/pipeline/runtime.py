"""Running the stages: options and layout checks, the pp group, torch's schedules, and
:class:`PipelinedModel` / :func:`build_pipeline`, the entry point ``schedlang.build`` calls."""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from ...errors import PipelineError
from .partition import _enclosing_paths, _partition
from .stages import _attach_unused_state, _check_cut_paths, _stage_module
from .tied import _exchange, _like, _local, _Tied, _tied_parameters
from .transport import _kind_of

logger = logging.getLogger("schedlang.distributed.pipeline")

#: the schedules ``options["schedule"]`` accepts; the second group holds several stages per rank
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "ZeroBubble")
_MULTI_STAGE = ("Interleaved1F1B", "ZeroBubble")
_OPTION_KEYS = ("schedule", "n_microbatches", "loss_fn", "example_inputs")


# ------------------------------------------------------------------------------------------------ options and layout
def _check_options(options: Any) -> Dict[str, Any]:
    if not isinstance(options, dict):
        raise PipelineError(f"pipeline: the options must be a dict {{'schedule': ..., 'n_microbatches': N, 'loss_fn': fn}}, "
                            f"got {options!r}")
    unknown = sorted(set(options) - set(_OPTION_KEYS))
    if unknown:
        raise PipelineError(f"pipeline: unknown option(s) {', '.join(map(repr, unknown))}: valid options are "
                            f"{', '.join(map(repr, _OPTION_KEYS))}")
    schedule = options.get("schedule", "1F1B")
    if schedule not in SCHEDULES:
        raise PipelineError(f"pipeline: unknown schedule {schedule!r}: valid schedules are "
                            f"{', '.join(map(repr, SCHEDULES))}")
    n = options.get("n_microbatches")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PipelineError(f"pipeline: option 'n_microbatches' must be a positive int, got {n!r}")
    loss_fn = options.get("loss_fn")
    if not callable(loss_fn):
        raise PipelineError(f"pipeline: option 'loss_fn' must be a callable fn(output, target) -> scalar loss, got "
                            f"{loss_fn!r}")
    examples = options.get("example_inputs")
    if examples is not None and (isinstance(examples, torch.Tensor) or not isinstance(examples, (tuple, list))):
        raise PipelineError(f"pipeline: option 'example_inputs' must be a tuple of example model inputs, got "
                            f"{type(examples).__name__}")
    return {"schedule": schedule, "n_microbatches": n, "loss_fn": loss_fn, "example_inputs": examples}


def _check_layout(n_stages: int, pp_size: int, opts: Dict[str, Any], cut_paths: Sequence[str]) -> int:
    schedule, n = opts["schedule"], opts["n_microbatches"]
    cuts = f"{len(cut_paths)} cut{'s' if len(cut_paths) != 1 else ''} ({', '.join(cut_paths)}) make {n_stages} stages"
    if n_stages % pp_size:
        raise PipelineError(f"pipeline: {cuts}, which do not divide over the {pp_size} pp ranks: every rank must hold the same "
                            f"number of stages; cut {pp_size - 1} times for one stage per rank, {2 * pp_size - 1} "
                            "for two")
    per_rank = n_stages // pp_size
    if schedule not in _MULTI_STAGE and per_rank != 1:
        raise PipelineError(f"pipeline: {cuts} for {pp_size} pp ranks ({per_rank} per rank), but the {schedule} schedule runs "
                            f"one stage per rank: cut {pp_size - 1} time(s), or use a multi-stage schedule "
                            f"({', '.join(_MULTI_STAGE)})")
    if schedule in _MULTI_STAGE and per_rank < 2:
        raise PipelineError(f"pipeline: {cuts} for {pp_size} pp ranks (1 per rank), but the {schedule} schedule interleaves "
                            f"several stages per rank: cut {2 * pp_size - 1} times (2 stages per rank), or use "
                            "1F1B or GPipe")
    if schedule == "1F1B" and n < n_stages:
        raise PipelineError(f"pipeline: the 1F1B schedule needs at least as many microbatches as stages: n_microbatches={n} < "
                            f"{n_stages} stages")
    if schedule in _MULTI_STAGE:
        rounds = max(1, n // pp_size)
        if n % rounds:
            raise PipelineError(f"pipeline: the {schedule} schedule runs microbatches in rounds of the {pp_size} pp ranks: "
                                f"n_microbatches={n} must be a multiple of {rounds} (use a multiple of {pp_size})")
    return per_rank


def _pp_group(pp_group_or_mesh):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise PipelineError("pipeline: stages need torch.distributed to be initialized (one process per pp rank, e.g. "
                            "under torchrun)")
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover
        DeviceMesh = ()
    if DeviceMesh and isinstance(pp_group_or_mesh, DeviceMesh):
        if pp_group_or_mesh.ndim != 1:
            raise PipelineError(f"pipeline: the mesh must be 1-D (the 'pp' dimension), got dimensions "
                                f"{pp_group_or_mesh.mesh_dim_names}")
        group = pp_group_or_mesh.get_group()
    elif pp_group_or_mesh is None:
        group = dist.group.WORLD
    elif isinstance(pp_group_or_mesh, dist.ProcessGroup):
        group = pp_group_or_mesh
    else:
        raise PipelineError(f"pipeline: the pp ranks must be given as a 1-D DeviceMesh or a ProcessGroup, got "
                            f"{type(pp_group_or_mesh).__name__}")
    return group, dist.get_rank(group), dist.get_world_size(group)


class PipelinedModel(nn.Module):
    """This rank's pipeline stages and the torch schedule that runs them.

    ``stage_modules`` (an ``nn.ModuleList``) holds this rank's stage modules, each keeping the
    original model's names for its tensors; ``stages`` the ``PipelineStage`` objects and
    ``schedule`` the torch schedule. Train with :meth:`step`; calling the model directly is an
    error (a pipeline needs every pp rank to take part).

    Example::

        losses = []
        out = model.step(input_ids, target=labels, losses=losses)   # logits on the last stage, else None
        optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, stage_modules: Sequence[nn.Module], stages: Sequence[Any], schedule: Any,
                 stage_indices: Sequence[int], n_stages: int, group, pp_rank: int, pp_size: int,
                 schedule_name: str, n_microbatches: int, tied: Sequence[_Tied]):
        super().__init__()
        self.stage_modules = nn.ModuleList(stage_modules)
        self.stages = list(stages)
        self.schedule = schedule
        self.stage_indices = list(stage_indices)
        self.n_stages = n_stages
        self.pp_group = group
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.schedule_name = schedule_name
        self.n_microbatches = n_microbatches
        self._tied = list(tied)

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first stage (it takes the inputs)."""
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (it computes the loss and returns the output)."""
        return self.n_stages - 1 in self.stage_indices

    def forward(self, *args, **kwargs):
        raise PipelineError("pipeline: a PipelinedModel cannot be called like the model: every pp rank must take part in each "
                            "step; use model.step(inputs, target=labels, losses=[]) on every rank")

    def step(self, *inputs, target=None, losses: Optional[list] = None):
        """One schedule step over a full batch: forward and backward of every microbatch.

        ``inputs`` go to the first stage (split into ``n_microbatches`` along dim 0; other ranks
        may pass them or not), ``target`` to the last stage's ``loss_fn``; the last stage appends
        one loss per microbatch to ``losses``. Gradients end up as the gradient of the mean loss
        over the full batch (see the module docstring). Returns the last stage's output (the
        microbatch outputs concatenated) on the rank holding it, else None.
        """
        if self.is_first:
            if not inputs:
                raise PipelineError(f"pipeline: pp rank {self.pp_rank} holds the first pipeline stage: step() needs the model "
                                    "inputs, e.g. model.step(input_ids, target=labels)")
            for i, x in enumerate(inputs):
                if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % self.n_microbatches):
                    raise PipelineError(f"pipeline: input {i} has shape {tuple(x.shape)}: its batch dimension (dim 0) must "
                                        f"divide into n_microbatches={self.n_microbatches} equal microbatches")
        if self.is_last:
            if target is None:
                raise PipelineError(f"pipeline: pp rank {self.pp_rank} holds the last pipeline stage: step() needs target= for "
                                    "the loss")
            if isinstance(target, torch.Tensor) and (target.dim() == 0 or target.shape[0] % self.n_microbatches):
                raise PipelineError(f"pipeline: target has shape {tuple(target.shape)}: its batch dimension (dim 0) must "
                                    f"divide into n_microbatches={self.n_microbatches} equal microbatches")
        if losses is not None and not isinstance(losses, list):
            raise PipelineError(f"pipeline: losses must be a list (the last stage appends one loss per microbatch), got "
                                f"{type(losses).__name__}")
        # torch 2.11 checks every microbatch against the first one's strides: hand it contiguous inputs
        args = tuple(x.contiguous() if isinstance(x, torch.Tensor) else x for x in inputs) if self.is_first else ()
        out = self.schedule.step(*args, target=target if self.is_last else None,
                                 losses=losses if self.is_last else None)
        self._finish_gradients()
        return out if self.is_last else None

    @torch.no_grad()
    def _finish_gradients(self) -> None:
        seen = set()
        for module in self.stage_modules:
            for p in module.parameters():
                if id(p) in seen or p.grad is None:
                    continue
                seen.add(id(p))
                p.grad.div_(self.n_microbatches)
        for tied in self._tied:
            p = tied.param
            if p is None:
                continue
            grad = _local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))
            copies = _exchange(grad.contiguous(), tied.holders, self.pp_rank, self.pp_group)
            total = copies[0].clone()
            for c in copies[1:]:
                total.add_(c)
            if p.grad is None:
                p.grad = _like(p, total)
            else:
                _local(p.grad).copy_(total)

    def __repr__(self) -> str:
        lines = [f"PipelinedModel(schedule={self.schedule_name}, n_microbatches={self.n_microbatches}, "
                 f"pp_rank={self.pp_rank}/{self.pp_size}, stages={self.stage_indices} of {self.n_stages}"]
        for index, module in zip(self.stage_indices, self.stage_modules):
            top = [n for n, _ in module.named_children() if not n.startswith("_schedlang_const")]
            n_params = sum(p.numel() for p in module.parameters())
            lines.append(f"  stage {index}: {', '.join(top) or 'no submodules'} ({n_params} parameters)")
        if self._tied:
            lines.append("  tied: " + "; ".join(" = ".join(t.names) + f" on pp ranks {t.holders}" for t in self._tied))
        return "\n".join(lines) + "\n)"


def _schedule(name: str, stages: List[Any], n: int, loss_fn: Callable):
    from torch.distributed import pipelining as pp

    def loss(output, target):
        value = loss_fn(output, target)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise PipelineError(f"pipeline: loss_fn must return a scalar tensor, got {_kind_of(value)}")
        return value

    if name == "GPipe":
        return pp.ScheduleGPipe(stages[0], n, loss_fn=loss, scale_grads=False)
    if name == "1F1B":
        return pp.Schedule1F1B(stages[0], n, loss_fn=loss, scale_grads=False)
    if name == "Interleaved1F1B":
        return pp.ScheduleInterleaved1F1B(stages, n, loss_fn=loss, scale_grads=False)
    return pp.ScheduleInterleavedZeroBubble(stages, n, loss_fn=loss, scale_grads=False)


def _data_parallel_wrapped(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    if isinstance(module, FSDPModule):
        return True
    try:  # the composable replicate (DDP) keeps its state in a registry
        from torch.distributed._composable_state import _get_module_state
    except ImportError:  # pragma: no cover
        return False
    return _get_module_state(module) is not None


def _check_prepared_stage(stage: nn.Module, index: int, enclosing: Sequence[str], schedule: str) -> None:
    """What ``prepare_stage`` did must still work in a stage."""
    for path in enclosing:
        try:
            module = stage.get_submodule(path)
        except AttributeError:
            continue
        if _data_parallel_wrapped(module):
            raise PipelineError(f"{path}: this module encloses a pipeline cut, so its forward is split across stages "
                                "and never called as a whole; data parallelism (fully_shard / replicate) on it would "
                                "never gather or reduce anything: apply it to its layers and to the root instead")
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()
    if schedule == "ZeroBubble" and FSDPModule and any(isinstance(m, FSDPModule) for m in stage.modules()):
        # measured (torch 2.13, gloo): the losses of later steps drift from one process, while
        # ZeroBubble alone, ZeroBubble with replicate, and Interleaved1F1B with fully_shard agree
        raise PipelineError(f"stage {index}: the ZeroBubble schedule computes weight gradients apart from input "
                            "gradients, which FSDP2 (fully_shard) does not reduce correctly here; use Interleaved1F1B "
                            "with fully_shard, or replicate with ZeroBubble")


def build_pipeline(model: nn.Module, cut_paths: Sequence[str], pp_group_or_mesh, options: dict,
                   device: torch.device, prepare_stage: Optional[Callable[[nn.Module], None]] = None,
                   allocate: Optional[Callable[[Sequence[nn.Module]], Dict[int, torch.Tensor]]] = None
                   ) -> PipelinedModel:
    """Split ``model`` after ``cut_paths`` and run this rank's stages with torch's pipeline schedules.

    ``cut_paths``: the plan's ``cut_pipeline_stage`` paths (any order; sorted by execution
    order); ``n`` cuts make ``n + 1`` stages, spread over the ``P`` ranks of ``pp_group_or_mesh``
    (a 1-D ``DeviceMesh`` or a ``ProcessGroup``; None: the world) in loops: stage ``s`` on rank
    ``s % P``. ``options``: ``{"schedule": "1F1B" | "GPipe" | "Interleaved1F1B" | "ZeroBubble",
    "n_microbatches": N, "loss_fn": fn(output, target) -> scalar}``, optionally ``"example_inputs"``
    (a tuple like the model's inputs, for models other than transformers). ``device``: where the model
    and its stages live. ``prepare_stage(stage_module)`` runs on each local stage module after
    the split and before its ``PipelineStage`` is made (data parallelism goes here).
    ``allocate(local_stage_modules)``, for a model still on the meta device: allocates the tensors of this
    rank's stages only, right after the split (``schedlang.build`` passes it, so that a rank never holds the
    whole model); returns ``{id(meta tensor): new tensor}``.

    Every rank must call this with the same model structure and arguments.

    Example::

        pipe = build_pipeline(model, ["model.layers.1"], dist.group.WORLD,
                              {"schedule": "GPipe", "n_microbatches": 4, "loss_fn": loss_fn},
                              torch.device("cpu"))
        pipe.step(input_ids, target=labels, losses=losses)
    """
    pipelined = _build_pipeline(model, cut_paths, pp_group_or_mesh, options, device, prepare_stage, allocate)
    # the split's graph modules and the other ranks' stages sit in reference cycles (a graph and its owning
    # module): unreachable once the build returns, they would hold the whole model's unsharded tensors on the
    # device until Python's next full collection (on a GPU, the first of 2 stages allocated twice its tensors)
    gc.collect()
    return pipelined


def _build_pipeline(model: nn.Module, cut_paths: Sequence[str], pp_group_or_mesh, options: dict,
                    device: torch.device, prepare_stage: Optional[Callable[[nn.Module], None]],
                    allocate) -> PipelinedModel:
    from torch.distributed.pipelining import PipelineStage

    opts = _check_options(options)
    cut_paths = _check_cut_paths(model, cut_paths)
    group, pp_rank, pp_size = _pp_group(pp_group_or_mesh)
    n_stages = len(cut_paths) + 1
    _check_layout(n_stages, pp_size, opts, cut_paths)
    device = torch.device(device)
    split = _partition(model, cut_paths, opts["example_inputs"])
    order = [n.target for n in split.cut_nodes]
    all_stages = [_stage_module(split, model, s, device) for s in range(n_stages)]
    enclosing = _enclosing_paths(cut_paths)
    _attach_unused_state(all_stages, model, enclosing)
    local = [s for s in range(n_stages) if s % pp_size == pp_rank]
    tied = _tied_parameters(all_stages, lambda s: s % pp_size)  # by identity: before the stages get new tensors
    if allocate is not None:
        allocated = allocate([all_stages[s] for s in local])
        tied = [_Tied(t.names, allocated.get(id(t.param), t.param), t.holders) for t in tied]
    kept = {id(p) for s in local for p in all_stages[s].parameters()}
    my_tied = []
    for t in tied:
        if pp_rank not in t.holders:
            continue
        mine = t.param if id(t.param) in kept else None
        my_tied.append(_Tied(t.names, mine, t.holders))
        if len(t.holders) > 1:
            with torch.no_grad():  # the copies start from the lowest holder's values
                value = _local(mine.data).contiguous()
                copies = _exchange(value, t.holders, pp_rank, group)
                if copies[0] is not value:
                    _local(mine.data).copy_(copies[0])
            logger.info("tied parameter %s held by pp ranks %s: gradients are summed every step",
                        " = ".join(t.names), t.holders)
    my_tied = [t for t in my_tied if len(t.holders) > 1]
    modules, stages = [], []
    for s in local:
        module = all_stages[s]
        if prepare_stage is not None:
            prepare_stage(module)
            _check_prepared_stage(module, s, enclosing, opts["schedule"])
        modules.append(module)
        stages.append(PipelineStage(module, s, n_stages, device, group=group))
    # data parallelism (prepare_stage) puts new Parameters in place of the stage's (FSDP2's sharded DTensors): each
    # tied record follows its names to the parameter the stage holds now, whose gradient the step must sum
    held = {name: p for module in modules for name, p in module.named_parameters(remove_duplicate=False)}
    my_tied = [_Tied(t.names, next((held[n] for n in t.names if n in held), t.param), t.holders)
               if t.param is not None else t for t in my_tied]
    _release_replaced_tensors(model, modules)
    schedule = _schedule(opts["schedule"], stages, opts["n_microbatches"], opts["loss_fn"])
    logger.info("pp rank %d/%d: stages %s of %d (cuts after %s), %s with %d microbatches", pp_rank, pp_size, local,
                n_stages, ", ".join(order), opts["schedule"], opts["n_microbatches"])
    return PipelinedModel(modules, stages, schedule, local, n_stages, group, pp_rank, pp_size, opts["schedule"],
                          opts["n_microbatches"], my_tied)


def _release_replaced_tensors(model: nn.Module, stage_modules: Sequence[nn.Module]) -> int:
    """Put meta tensors in the model the stages were split from wherever it holds a tensor on a device that no
    stage of this rank holds; returns how many. The stages share the model's tensors until data parallelism
    prepares them: FSDP2 then puts its sharded parameters in the stages, and the model's references would keep a
    whole unsharded copy of the rank's stages on the device (25 GB a rank for LLaMA-3.1-405B at tp 8, pp 8).
    The model keeps its structure (names, shapes, dtypes); its tensors are the stages'. The stages' own tensors,
    those they share with the model where nothing replaced them, are left as they are."""
    held = {id(t) for module in stage_modules for t in list(module.parameters()) + list(module.buffers())}
    released = 0
    for sub in model.modules():
        for store, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for name, t in list(store.items()):
                if t is None or id(t) in held or t.device.type == "meta":
                    continue
                empty = torch.empty(t.shape, dtype=t.dtype, device="meta")
                store[name] = nn.Parameter(empty, requires_grad=t.requires_grad) if is_param else empty
                released += 1
    return released


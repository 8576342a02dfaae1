"""Data parallelism on the mesh's data dimensions: FSDP2 (``fully_shard``) and DDP (``replicate``).

The ``fully_shard`` and ``replicate`` primitives only record what to do; ``build`` calls
:func:`apply_data_parallel` on the materialized model, after tensor-parallel parameters became
DTensors on the ``tp`` dimension (FSDP2 then shards them further along ``dp``, a 2-D layout) and,
with pipelining, on each stage that this rank holds. Inner modules are wrapped before outer
ones, as FSDP2 requires, whatever order the schedule named them in.

``replicate`` has two engines:

* by default torch's FSDP-based ``replicate``: parameters become ``Replicate()`` DTensors, cast
  and reduced by the ``mp_policy`` like FSDP2's (it composes with tensor parallelism on a 2-D
  mesh);
* with fp32 master weights (``build(..., master_weights=True)``), torch's DDP (the composable,
  DDP-based ``replicate``): the parameters stay the plain tensors the fused optimizer turned into
  bf16 copies of its fp32 masters, and gradients are all-reduced in buckets while the backward
  still runs. DDP builds its buckets at the first forward, after the optimizer changed the
  parameters' dtypes. The policy's ``reduce_dtype`` (fp32 by default) is honoured by a DDP
  communication hook (:func:`reduce_in_dtype`) that sums a low-precision bucket in that dtype;
  ``reduce_dtype="bfloat16"`` sums it as it is, with no casts.

Mixed precision is FSDP2's ``MixedPrecisionPolicy``. A step's ``mp_policy`` is kept in the plan
as plain data: ``None`` (the default: bf16 parameters and fp32 gradient reduction on a GPU,
full fp32 on the CPU), ``"bf16"``, ``"fp32"`` or a dict of the policy's fields with dtype names.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..errors import ScheduleTypeError, ScheduleValueError

__all__ = ["normalize_mp_policy", "make_mp_policy", "apply_data_parallel", "DATA_PARALLEL_PRIMITIVES",
           "ReduceState", "reduce_in_dtype", "DDP_BUCKET_CAP_MB", "set_gradient_sync"]

logger = logging.getLogger("schedlang.distributed.data_parallel")

DATA_PARALLEL_PRIMITIVES = ("fully_shard", "replicate")
_POLICY_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float": "float32", "half": "float16"}
#: DDP's gradient bucket size: torchtitan's choice; fewer, larger all-reduces than DDP's 25 MB default
DDP_BUCKET_CAP_MB = 100


def _dtype_name(value, where: str) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        for name, dtype in _DTYPES.items():
            if dtype == value:
                return name
    elif isinstance(value, str):
        name = _ALIASES.get(value, value)
        if name in _DTYPES:
            return name
    raise ScheduleValueError(f"{where}: {value!r} is not a supported dtype; valid: "
                             f"{', '.join(list(_DTYPES) + list(_ALIASES))} or None")


def normalize_mp_policy(policy: Any, where: str) -> Any:
    """The plan's form of a mixed-precision policy: None, or a dict of dtype names (see the module docstring)."""
    if policy is None:
        return None
    if isinstance(policy, str):
        name = _ALIASES.get(policy, policy)
        if name == "bfloat16":
            return {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": None,
                    "cast_forward_inputs": True}
        if name == "float32":
            return {"param_dtype": None, "reduce_dtype": None, "output_dtype": None, "cast_forward_inputs": True}
        raise ScheduleValueError(f"{where}: mp_policy {policy!r} is not known: valid names are 'bf16' (bf16 "
                                 "parameters, fp32 reduction) and 'fp32', or a MixedPrecisionPolicy")
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # pragma: no cover - torch without FSDP2
        MixedPrecisionPolicy = ()
    if MixedPrecisionPolicy and isinstance(policy, MixedPrecisionPolicy):
        policy = {f: getattr(policy, f) for f in _POLICY_FIELDS}
    if not isinstance(policy, dict):
        raise ScheduleTypeError(f"{where}: mp_policy must be None, 'bf16', 'fp32', a dict or a "
                                f"torch.distributed.fsdp.MixedPrecisionPolicy, got {type(policy).__name__}")
    unknown = sorted(set(policy) - set(_POLICY_FIELDS))
    if unknown:
        raise ScheduleValueError(f"{where}: unknown mp_policy field(s) {', '.join(unknown)}: valid fields are "
                                 f"{', '.join(_POLICY_FIELDS)}")
    out = {f: _dtype_name(policy.get(f), f"{where}, mp_policy['{f}']") for f in _POLICY_FIELDS[:3]}
    cast = policy.get("cast_forward_inputs", True)
    if not isinstance(cast, bool):
        raise ScheduleTypeError(f"{where}: mp_policy['cast_forward_inputs'] must be a bool, got {cast!r}")
    out["cast_forward_inputs"] = cast
    return out


def make_mp_policy(spec: Optional[Dict[str, Any]], device: torch.device):
    """FSDP2's MixedPrecisionPolicy for the plan's form ``spec`` on ``device``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if spec is None:
        spec = normalize_mp_policy("bf16" if device.type == "cuda" else "fp32", "mp_policy")
    return MixedPrecisionPolicy(param_dtype=_DTYPES.get(spec["param_dtype"]),
                                reduce_dtype=_DTYPES.get(spec["reduce_dtype"]),
                                output_dtype=_DTYPES.get(spec["output_dtype"]),
                                cast_forward_inputs=spec["cast_forward_inputs"])


def _submodule(root: nn.Module, path: str) -> Optional[nn.Module]:
    module = root
    for part in path.split(".") if path else ():
        module = module._modules.get(part) if module is not None else None
        if module is None:
            return None
    return module


def apply_data_parallel(model: nn.Module, steps: Iterable[Tuple[str, str, Dict[str, Any]]], dp_mesh,
                        device: torch.device, missing_ok: bool = False,
                        master_weights: Optional[torch.dtype] = None) -> List[str]:
    """Apply the recorded ``fully_shard`` / ``replicate`` steps (``(primitive, path, args)``) to ``model``.

    Deepest modules first. ``missing_ok``: skip paths ``model`` does not hold (a pipeline stage holds
    only part of the model). ``master_weights``: the compute dtype of an optimizer that will keep fp32
    masters of plain parameters; ``replicate`` then runs on DDP (see the module docstring) and
    ``fully_shard`` is refused (checked by :func:`check_master_weights_layout` before anything runs).
    Returns the paths wrapped, in the order they were wrapped.
    """
    steps = list(steps)
    ordered = sorted(steps, key=lambda s: (-(s[1].count(".") + 1 if s[1] else 0), s[1]))
    done = _spread_experts_data_parallel(model, steps, dp_mesh, device, master_weights)
    for primitive, path, args in ordered:
        module = _submodule(model, path)
        if module is None:
            if missing_ok:
                continue
            raise ScheduleValueError(f"{path or '<root>'}: {primitive} was recorded for a module the built model does "
                                     "not hold; build the model the schedule was created for, or call "
                                     f"{primitive} at a path it holds")
        if not any(True for _ in module.parameters()):
            logger.info("%s: no parameters here (this pipeline stage holds none of them); %s skipped",
                        path or "<root>", primitive)
            continue
        if master_weights is not None and primitive == "replicate":
            outer = _enclosing_step(path, steps, model if missing_ok else None)
            if outer is not None:  # one DDP over the outer module already reduces these gradients
                logger.info("%s: replicate is covered by the one at %s (DDP reduces every gradient under it)",
                            path or "<root>", outer or "<root>")
                continue
            _replicate_with_ddp(module, dp_mesh, args.get("mp_policy"), master_weights, path)
            logger.info("%s: replicate (DDP, plain %s parameters with fp32 masters) on %s", path or "<root>",
                        master_weights, dp_mesh)
            done.append(path)
            continue
        policy = make_mp_policy(args.get("mp_policy"), device)
        if primitive == "fully_shard":
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

            options = {"mesh": dp_mesh, "mp_policy": policy,
                       "offload_policy": CPUOffloadPolicy() if args.get("offload") else OffloadPolicy()}
            if args.get("reshard_after_forward") is not None:
                options["reshard_after_forward"] = args["reshard_after_forward"]
            fully_shard(module, **options)
        else:
            _replicate(module, dp_mesh, policy)
        logger.info("%s: %s on %s", path or "<root>", primitive, dp_mesh)
        done.append(path)
    return done


def _spread_experts_data_parallel(model: nn.Module, steps, dp_mesh, device: torch.device,
                                  master_weights: Optional[torch.dtype]) -> List[str]:
    """The data parallelism of expert-parallel experts (their own unit, before the enclosing ones take the rest).

    Ranks of an expert-parallel group hold different experts, so the experts' gradients must not be reduced
    over the data-parallel mesh: they run FSDP2 (or replicate) on their expert mesh's ``ep_replicate`` ranks,
    which hold the same experts. Each arrives holding the sum over its expert-parallel group's losses (see
    :mod:`schedlang.distributed.expert_parallel`); summed over the replicas it is the sum over every
    data-parallel rank's loss, so it is divided by the whole data-parallel size, as every other gradient is."""
    from .expert_parallel import ExpertParallelExperts, expert_mesh_of

    if not steps:
        return []
    done = []
    for path, module in model.named_modules():
        if not isinstance(module, ExpertParallelExperts):
            continue
        mesh2d = expert_mesh_of(module)
        if mesh2d is None:
            raise ScheduleValueError(
                f"{path}: the experts are spread over a process group without an expert mesh, so which ranks hold "
                "the same experts (the ranks their data parallelism runs on) is unknown; spread them with "
                "expert_parallel(expert_mesh(mesh, ep)) (schedlang.distributed.expert_mesh)")
        primitive, _, args = steps[0]
        if master_weights is not None and primitive == "replicate":
            raise ScheduleValueError(f"{path}: replicate with fp32 master weights runs on DDP, which cannot leave the "
                                     "expert-parallel experts to their own replicas; use fully_shard, or an "
                                     "optimizer without master weights")
        policy = make_mp_policy(args.get("mp_policy"), device)
        replicas = mesh2d["ep_replicate"]
        if primitive == "fully_shard":
            from torch.distributed.fsdp import fully_shard

            fully_shard(module, mesh=replicas, mp_policy=policy)
        else:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(module, mesh=replicas, mp_policy=policy)
        module.set_gradient_divide_factor(float(dp_mesh.size()))
        if replicas.device_type == "cpu" and primitive == "fully_shard" and replicas.size() > 1:
            # gloo has no pre-multiplied sum: sum, then divide
            module.set_force_sum_reduction_for_comms(True)
        logger.info("%s: %s of the experts on their %d replica(s), gradients divided by %d", path, primitive,
                    replicas.size(), dp_mesh.size())
        done.append(path)
    return done


def _replicate(module: nn.Module, dp_mesh, policy) -> None:
    """torch's FSDP-based composable ``replicate`` (parameter names unchanged, so checkpoints still match)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicate(module, mesh=dp_mesh, mp_policy=policy)


def _enclosing_step(path: str, steps, model: Optional[nn.Module]) -> Optional[str]:
    """The path of a recorded ``replicate`` on a module that contains ``path`` (and that ``model`` holds,
    when given), or None."""
    for primitive, other, _ in steps:
        if primitive != "replicate" or other == path:
            continue
        if (other == "" or path.startswith(other + ".")) and (model is None or _submodule(model, other) is not None):
            return other
    return None


def check_master_weights_layout(steps, dp_mesh, compute_dtype: Optional[torch.dtype] = None, where: str = "build"
                                ) -> None:
    """Raise (before anything is wrapped) unless the data-parallel steps can keep plain parameters for an
    optimizer with fp32 master weights: ``replicate`` on a 1-D data mesh, with a policy DDP can honour."""
    for primitive, path, args in steps:
        at = path or "<root>"
        if primitive == "fully_shard":
            raise ScheduleValueError(
                f"{where}: master_weights=True keeps plain bf16 parameters with fp32 masters in the optimizer, but "
                f"the plan has fully_shard at '{at}' (FSDP2 turns parameters into sharded DTensors and keeps its own "
                "fp32 copy through mp_policy); use replicate for data parallelism with master weights, or "
                "master_weights=False with fully_shard")
        if dp_mesh is not None and dp_mesh.ndim != 1:
            raise ScheduleValueError(
                f"{where}: master_weights=True runs replicate at '{at}' on DDP, which takes a 1-D data mesh; this "
                f"one has dimensions {dp_mesh.mesh_dim_names}; use a mesh with one 'dp' dimension, or "
                "master_weights=False")
        _ddp_reduce_dtype(args.get("mp_policy"), compute_dtype, f"{where}: {at}: replicate")


def _ddp_reduce_dtype(spec: Optional[Dict[str, Any]], compute_dtype: Optional[torch.dtype], where: str
                      ) -> Optional[torch.dtype]:
    """The dtype DDP sums gradients in, from a plan's ``mp_policy`` under master weights (None: the gradients'
    own dtype). Parameter casts are the optimizer's business there: a policy may only restate them."""
    if spec is None:
        return torch.float32  # the GPU default policy's fp32 reduction, and the CPU default's fp32
    param = _DTYPES.get(spec["param_dtype"])
    if param is not None and compute_dtype is not None and param != compute_dtype:
        raise ScheduleValueError(
            f"{where}: mp_policy param_dtype={spec['param_dtype']} contradicts master_weights with compute_dtype "
            f"{compute_dtype}: the optimizer keeps the Linear weights in {compute_dtype} and the other parameters "
            "in fp32; valid are param_dtype None or equal to compute_dtype")
    if spec["output_dtype"] is not None:
        raise ScheduleValueError(
            f"{where}: mp_policy output_dtype={spec['output_dtype']} is FSDP2's cast of the module output, which "
            "DDP (replicate under master weights) does not do; valid is output_dtype None")
    return _DTYPES.get(spec["reduce_dtype"])


class ReduceState:
    """What :func:`reduce_in_dtype` needs: the data-parallel group and the dtype to sum gradients in."""

    def __init__(self, group, dtype: Optional[torch.dtype]):
        self.group = group
        self.dtype = dtype


def reduce_in_dtype(state: ReduceState, bucket):
    """DDP communication hook: the mean of a gradient bucket over the group, summed in ``state.dtype``.

    A bucket of another dtype (bf16 gradients of master-weights parameters) is cast up, averaged and
    all-reduced in that dtype and written back rounded once, as FSDP2's ``reduce_dtype`` does; a bucket
    already in it (or with ``dtype`` None) is averaged and all-reduced as it is, as DDP's default does.
    """
    import torch.distributed as dist

    buffer = bucket.buffer()
    world = dist.get_world_size(state.group)
    wide = state.dtype is not None and buffer.dtype != state.dtype
    work = buffer.to(state.dtype) if wide else buffer
    work.div_(world)
    future = dist.all_reduce(work, group=state.group, async_op=True).get_future()
    if not wide:
        return future.then(lambda f: f.value()[0])

    def write_back(f):
        buffer.copy_(f.value()[0])
        return buffer

    return future.then(write_back)


def _replicate_with_ddp(module: nn.Module, dp_mesh, spec, compute_dtype: torch.dtype, path: str) -> None:
    """torch's DDP-based composable ``replicate`` (parameter names unchanged), set up lazily: its buckets are
    made at the first forward, once the optimizer has turned the parameters into their compute-dtype copies."""
    from torch.distributed._composable import replicate as ddp_replicate

    reduce_dtype = _ddp_reduce_dtype(spec, compute_dtype, f"{path or '<root>'}: replicate")
    device = next(module.parameters()).device
    options: Dict[str, Any] = {"process_group": dp_mesh.get_group(), "bucket_cap_mb": DDP_BUCKET_CAP_MB,
                               # gradients live in the buckets: no copy into them, no second gradient buffer
                               "gradient_as_bucket_view": True}
    if device.type != "cpu":
        options["device_id"] = device
    ddp_replicate(module, **options)
    module.register_comm_hook(ReduceState(dp_mesh.get_group(), reduce_dtype), reduce_in_dtype)


def set_gradient_sync(model: nn.Module, on: bool) -> int:
    """Turn the gradient reduction of every ``replicate`` / ``fully_shard`` unit in ``model`` on or off.

    Off, a backward leaves each rank's gradients local and the next backward adds to them; the backward run
    with it on reduces the sum once. Gradient accumulation sets it off for all but its last microbatch, so
    the replicas communicate once per step instead of once per microbatch. Both ``replicate`` engines (the
    FSDP-based one, an ``FSDPModule``, and the DDP-based one) take the same switch; the DDP one reads it at its
    next forward. Returns the number of units switched.
    """
    from torch.distributed.fsdp import FSDPModule

    switched = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(on, recurse=False)
            switched += 1
        elif callable(getattr(module, "set_requires_gradient_sync", None)):
            module.set_requires_gradient_sync(on)  # torch's DDP-based composable replicate
            switched += 1
    return switched


def data_parallel_step_args(sch, primitive: str, mp_policy: Any) -> Dict[str, Any]:
    """The plan's arguments shared by ``fully_shard`` and ``replicate``, after their call-time checks."""
    policy = normalize_mp_policy(mp_policy, f"{sch.path or '<root>'}: {primitive}")
    check_data_parallel_call(sch, primitive)
    return {"mp_policy": policy}


def check_data_parallel_call(sch, primitive: str) -> None:
    """Call-time checks shared by ``fully_shard`` and ``replicate`` (raise, change nothing)."""
    from .groups import is_distributed
    from .mesh import data_parallel_mesh

    where = sch.path or "<root>"
    mesh = sch.mesh
    if mesh is None and is_distributed():
        raise ScheduleValueError(
            f"{where}: {primitive} runs on the mesh's data-parallel dimension, and this schedule has no mesh (its "
            "group is for tensor parallelism); create it with create_schedule(model, "
            "mesh=schedlang.distributed.mesh.make_mesh(dp=N, ...))")
    if mesh is not None and data_parallel_mesh(mesh) is None:
        raise ScheduleValueError(
            f"{where}: {primitive} needs a data-parallel mesh dimension; this mesh has {mesh.mesh_dim_names}: add "
            "'dp' (or 'dp_replicate' and 'dp_shard' for HSDP)")
    if primitive == "replicate" and mesh is not None and "dp" not in mesh.mesh_dim_names:
        raise ScheduleValueError(f"{where}: replicate (DDP) runs on a 'dp' mesh dimension; this mesh has "
                                 f"{mesh.mesh_dim_names}; use a mesh with a 'dp' dimension, or fully_shard for an "
                                 "HSDP mesh")
    if not any(True for _ in sch.mod.parameters()):
        raise ScheduleValueError(f"{where}: {type(sch.mod).__name__} holds no parameters; call "
                                 f"{primitive} on a module that does (a decoder layer, or the root)")
    other = "replicate" if primitive == "fully_shard" else "fully_shard"
    for step in sch.plan:
        if step.primitive == other:
            raise ScheduleValueError(f"{where}: the schedule already has {other} (at '{step.path or '<root>'}'); a "
                                     "model uses only one kind of data parallelism, fully_shard (FSDP2) or replicate "
                                     "(DDP); use the same one here")
        if step.primitive == primitive and step.path == sch.path:
            raise ScheduleValueError(f"{where}: {primitive} was already applied here; call it once per module")


def data_parallel_steps(plan) -> List[Tuple[str, str, Dict[str, Any]]]:
    """``(primitive, path, args)`` of the plan's data-parallel steps."""
    return [(s.primitive, s.path, s.args) for s in plan if s.primitive in DATA_PARALLEL_PRIMITIVES]

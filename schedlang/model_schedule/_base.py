"""Pieces the family schedules share: preparing the schedule, Megatron-style linear pairs,
checkpointing a fraction of the layers, fusing a bias add with its activation, and shard rules
that keep attention head counts right for HF attention classes that read them in forward."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch
from torch import nn

from ..errors import ScheduleTypeError, ScheduleValueError, ShardError
from ..logger import get_logger

__all__ = ["prepare", "shard_column", "shard_row", "shard_block", "checkpoint_ratio", "fuse_bias_act",
           "register_head_count_rule", "finish"]

logger = get_logger("schedlang.model_schedule")

_KNOWN_OPTIONS = {"group", "mesh", "ckpt_ratio", "fuse", "fp16", "bf16", "model_config", "prefix", "delay_init",
                  "attn_op_name", "sequence_parallel", "gather_logits"}


def prepare(model, sch_config: Dict[str, Any], family: str):
    """The schedule to write into: ``model`` itself when it is a Schedule, else a new one (after
    the dtype change ``fp16`` / ``bf16`` asks for, on a copy)."""
    from ..schedule import Schedule, create_schedule

    unknown = set(sch_config) - _KNOWN_OPTIONS
    if unknown:
        raise ScheduleTypeError(f"apply_schedule({family!r}): unknown options {sorted(unknown)}; valid are "
                                f"{', '.join(sorted(_KNOWN_OPTIONS))}")
    ratio = sch_config.get("ckpt_ratio", 0.0)
    if not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ScheduleValueError(f"apply_schedule({family!r}): ckpt_ratio must be a number in [0, 1], got {ratio!r}")
    if sch_config.get("fp16") and sch_config.get("bf16"):
        raise ScheduleValueError(f"apply_schedule({family!r}): fp16 and bf16 are exclusive")
    if isinstance(model, Schedule):
        return model
    if not isinstance(model, nn.Module):
        raise ScheduleTypeError(f"apply_schedule({family!r}): expects an nn.Module or a Schedule, got "
                                f"{type(model).__name__}")
    dtype = torch.float16 if sch_config.get("fp16") else torch.bfloat16 if sch_config.get("bf16") else None
    sch = create_schedule(model, group=sch_config.get("group"), mesh=sch_config.get("mesh"))
    if dtype is not None:
        sch.mod.to(dtype)  # the working copy only; the user's model keeps its dtype
    return sch


def shard_column(lin) -> None:
    """Split the outputs of a Linear (weight and bias along axis 0); its input gradient is summed."""
    lin.shard("weight", axis=0)
    if getattr(lin.mod, "bias", None) is not None:
        lin.shard("bias", axis=0)
    lin.sync(mode="bwd_post", sync_op_or_fn="all_reduce")


def shard_row(lin) -> None:
    """Split the inputs of a Linear (weight axis 1); its partial outputs are summed (before the bias)."""
    lin.shard("weight", axis=1)
    lin.sync(mode="fwd_post", sync_op_or_fn="all_reduce")


def shard_block(block, columns: Iterable[str], row: str) -> None:
    """Megatron pair: ``columns`` column parallel (each rank its heads / its slice of the MLP), ``row``
    row parallel. Each column Linear sums its own input gradient, which is right when they read
    different inputs too (cross attention)."""
    for name in columns:
        shard_column(block[name])
    shard_row(block[row])


def checkpoint_ratio(layers: List, ratio: float) -> int:
    """Checkpoint the first ``ratio * len(layers)`` layers (rounded half up); returns how many."""
    count = int(ratio * len(layers) + 0.5)  # half rounds up: 0.5 of one layer checkpoints it
    for layer in layers[:count]:
        layer.checkpoint()
    return count


_ACT_NAMES = {"GELUActivation": "gelu", "NewGELUActivation": "gelu_new", "GELUTanh": "gelu_new",
              "PytorchGELUTanh": "gelu_new", "FastGELUActivation": None, "ReLU": "relu", "SiLU": "silu",
              "SiLUActivation": "silu"}


def _act_name(module: nn.Module) -> Optional[str]:
    if type(module) is nn.GELU:
        return "gelu" if module.approximate == "none" else "gelu_new"
    return _ACT_NAMES.get(type(module).__name__)


def fuse_bias_act(parent, linear: str, act: str) -> bool:
    """Replace ``parent[linear]`` (a Linear with bias) followed by ``parent[act]`` by one
    :class:`~schedlang.op.LinearWithAct` holding the same parameters, and the activation by an
    identity. Returns False (and changes nothing) when the activation is not one it knows."""
    from ..op import LinearWithAct

    lin, act_mod = parent[linear].mod, parent[act].mod
    name = _act_name(act_mod)
    if name is None or not isinstance(lin, nn.Linear) or lin.bias is None:
        return False
    fused = LinearWithAct(lin.in_features, lin.out_features, act_fn=name, device="meta")
    fused.weight, fused.bias = lin.weight, lin.bias
    parent[linear].replace(fused)
    parent[act].replace(nn.Identity())
    return True


def delegate(model, sch_config: Dict[str, Any], family: str, shard_fn, base: str, layer_list: str):
    """A family whose tensor parallelism is a ready-made schedule of :mod:`schedlang.models` (``shard_fn``):
    prepare, shard over several ranks, then checkpoint and finish over the layers ``base.layer_list``."""
    sch = prepare(model, sch_config, family)
    if sch.world_size > 1:
        shard_fn(sch, sequence_parallel=sch_config.get("sequence_parallel", False),
                 gather_logits=sch_config.get("gather_logits", True))
    root = sch[base] if base in sch.child else sch
    return finish(sch, family, list(root[layer_list].child.values()), sch_config)


def schedule_layers(sch, layers: List, sch_config: Dict[str, Any], attention: tuple, mlp: tuple, fuse: tuple) -> None:
    """The per-layer part of a family schedule, all or nothing: with ``fuse=True`` in ``sch_config`` the bias
    and activation of ``fuse = (owner path, linear, activation)`` fused; over several ranks the attention
    ``(path, [q, k, v], out)`` and the MLP ``(path, [column...], row)`` sharded Megatron-style."""
    with sch.atomic():
        for layer in layers:
            if sch_config.get("fuse", False):
                owner, linear, act = fuse
                fuse_bias_act(layer[owner] if owner else layer, linear, act)
            if sch.world_size > 1:
                for path, columns, row in (attention, mlp):
                    shard_block(layer[path] if path else layer, columns, row)


def finish(sch, family: str, layers: List, sch_config: Dict[str, Any]):
    checkpointed = checkpoint_ratio(layers, sch_config.get("ckpt_ratio", 0.0))
    config = getattr(sch.mod, "config", None)
    if checkpointed and getattr(config, "use_cache", False):
        # a recomputed layer would append its keys and values to the KV cache a second time (HF turns the
        # cache off under its own gradient checkpointing for the same reason); training needs no cache
        config.use_cache = False
        logger.info("%s: use_cache turned off in the scheduled copy's config (checkpointed layers)", family)
    logger.info("%s: tensor parallel over %d rank(s), %d of %d layers checkpointed", family, sch.world_size,
                checkpointed, len(layers))
    return sch


def register_head_count_rule(type_name: str, query: str, heads_attr: str, head_dim_attr: str,
                             width_attrs: Iterable[str] = ()) -> None:
    """Register a shard rule for the HF attention class ``type_name`` whose forward reads its head
    count ``heads_attr``: sharding its ``query`` projection along axis 0 checks for whole heads and
    sets ``heads_attr`` (and ``width_attrs``, heads x head size) to the local values. Does nothing
    if schedlang already has a rule for that class."""
    from ..distributed.sharding import remember_unsharded
    from ..distributed.shard_rules import ShardRule, find_shard_rule, register_shard_rule

    if find_shard_rule(type(type_name, (nn.Module,), {})()) is not None:
        return
    width_attrs = tuple(width_attrs)

    def check_child_shard(cls, path, module, child_name, child, tensor_name, axis, world_size):
        if axis == 0 and tensor_name == "weight" and isinstance(child, nn.Linear) and child_name in cls.projections:
            head_dim = getattr(module, head_dim_attr)
            heads = child.weight.shape[0] // head_dim
            if heads % world_size:
                valid = ", ".join(str(w) for w in range(1, heads + 1) if heads % w == 0)
                raise ShardError(f"{path or '<root>'}: cannot shard {child_name}.weight over {world_size} ranks: "
                                 f"{type(module).__name__} has {heads} heads and every rank must hold whole heads; "
                                 f"valid world sizes: {valid}")
        return 1

    def after_child_shard(cls, module, child_name, child, tensor_name, axis, world_size, rank):
        if child_name != query or tensor_name != "weight" or axis != 0:
            return
        remember_unsharded(module, **{a: getattr(module, a) for a in (heads_attr,) + width_attrs})
        heads = child.weight.shape[0] // getattr(module, head_dim_attr)
        setattr(module, heads_attr, heads)
        for attr in width_attrs:
            setattr(module, attr, heads * getattr(module, head_dim_attr))

    rule = type(f"{type_name}HeadCountRule", (ShardRule,), {
        "module_type_names": (type_name,), "projections": ("q_proj", "k_proj", "v_proj", "q", "k", "v", query),
        "check_child_shard": classmethod(check_child_shard), "after_child_shard": classmethod(after_child_shard)})
    register_shard_rule(rule)

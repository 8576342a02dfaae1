"""``--ep``: expert parallelism carved from the data-parallel ranks.

With ``--dp 8 --ep 8`` each of the 8 data-parallel ranks holds 1/8 of every mixture-of-experts block's experts
(:mod:`schedlang.distributed.expert_parallel`); tokens travel to their experts' ranks and back by all-to-all.
The ranks that hold the same experts (``dp x cp / ep`` of them) run the experts' data parallelism: FSDP2 or
DDP on those ranks only (:mod:`schedlang.distributed.expert_mesh`), with the gradients divided by the whole
data-parallel size, so a step is one process's step on the mean loss. Every step reports the fewest and the
most tokens any expert of any block received (``tokens_per_expert_min`` / ``_max``).
"""

from __future__ import annotations

import argparse
import logging
from typing import Dict, Optional

import torch

from .flags import _fail

logger = logging.getLogger("schedlang.train")


def count_experts(model: torch.nn.Module) -> Optional[int]:
    """The number of experts of the model's mixture-of-experts blocks (None: a dense model). Blocks with
    different numbers of experts give the smallest."""
    from ..distributed.shard_rules.experts import is_experts

    counts = [int(m._parameters["down_proj"].shape[0]) for m in model.modules() if is_experts(m)]
    return min(counts) if counts else None


def check_expert_counts(ns: argparse.Namespace, experts: Optional[int]) -> None:
    """``--ep`` against the model's experts per block (:func:`count_experts`; None: a dense model): a mixture of
    experts whose number of experts ``--ep`` divides."""
    ep = getattr(ns, "ep", None) or 1
    if ep == 1:
        return
    if experts is None:
        _fail(f"--ep {ep}: {ns.model} {ns.config} is a dense model (no mixture-of-experts block with experts kept as "
              "3-D gate_up_proj/down_proj tensors); expert parallelism needs a MoE model (qwen3_moe, mixtral, olmoe, "
              "deepseek_v3 ...); drop --ep")
    if experts % ep:
        valid = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0 and (ns.dp * ns.cp) % d == 0)
        _fail(f"--ep {ep}: the model's blocks hold {experts} experts, which do not split over {ep} ranks; --ep must "
              f"divide {experts} and --dp x --cp = {ns.dp * ns.cp}: valid {valid}")


def make_expert_mesh(run) -> None:
    """The run's expert mesh (collective: every rank, once the trainer's mesh exists); None without --ep."""
    run.expert_mesh = None
    ep = getattr(run.ns, "ep", None) or 1
    if ep > 1:
        from ..distributed.expert_mesh import expert_mesh

        run.expert_mesh = expert_mesh(run.mesh, ep, device_type=run.device.type, timeout=run.ns.timeout)


def spread_experts(run, sch) -> None:
    """Spread every MoE block's experts over the run's expert mesh (before the data-parallel steps: build runs
    the experts' own data parallelism first)."""
    if getattr(run, "expert_mesh", None) is None:
        return
    sch.expert_parallel(run.expert_mesh)


def weigh_expert_gradients(run) -> None:
    """The gradient norm counts each element once: an expert slice's gradient lives on its ``ep_replicate``
    ranks only (a copy or a shard on each), the other ``ep - 1`` parts of the expert dimension on other ranks,
    so each piece weighs ``ep`` times what its placement alone says (see ``_Run._clip_shares``)."""
    if getattr(run, "expert_mesh", None) is None:
        return
    from ..distributed.expert_parallel import expert_modules

    ep = run.expert_mesh.size(0)
    for module in expert_modules(run.model).values():
        for name in module.expert_weight_shapes:
            param = module._parameters[name]
            run.grad_weight[id(param)] = run.grad_weight.get(id(param), 1.0) * ep


def expert_load(run) -> Dict[str, int]:
    """``{"tokens_per_expert_min": ..., "tokens_per_expert_max": ...}`` of the last forward over every expert of
    every block (empty without expert parallelism). Collective over the expert-parallel group."""
    if getattr(run, "expert_mesh", None) is None:
        return {}
    from ..distributed.expert_parallel import expert_modules, tokens_per_expert_range

    low, high = tokens_per_expert_range(list(expert_modules(run.model).values()), run.expert_mesh["ep"].get_group())
    return {"tokens_per_expert_min": low, "tokens_per_expert_max": high}


def load_text(record: Dict[str, int]) -> str:
    """``  tokens/expert 812..1344`` for the step line (empty without expert parallelism)."""
    if "tokens_per_expert_min" not in record:
        return ""
    return f"  tokens/expert {record['tokens_per_expert_min']}..{record['tokens_per_expert_max']}"

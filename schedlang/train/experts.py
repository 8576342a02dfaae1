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


def track_expert_load(run) -> None:
    """Count, for the step's metrics, the rows every local expert receives in each forward of the step: all the
    microbatches of an accumulated or pipelined step, not only the last (a spread experts module keeps the
    counts of its last forward only). A forward run again inside the backward (activation checkpointing's
    recomputation) routes the same tokens a second time and is not counted. ``run.expert_counts`` holds each
    block's readings of the step, one per forward."""
    run.expert_counts = {}
    if getattr(run, "expert_mesh", None) is None:
        return
    from ..distributed.expert_parallel import expert_modules

    def counted(path):
        def hook(module, args, output):
            if module.tokens_per_expert is None or torch._C._current_graph_task_id() != -1:
                return
            run.expert_counts.setdefault(path, []).append(module.tokens_per_expert.detach().to(torch.int64))
        return hook

    for path, module in expert_modules(run.model).items():
        module.register_forward_hook(counted(path))


def start_expert_load(run) -> None:
    """A new step: its expert load counts from zero (see :func:`track_expert_load`)."""
    run.expert_counts = {}


def expert_load(run) -> Dict[str, int]:
    """``{"tokens_per_expert_min": ..., "tokens_per_expert_max": ...}`` of the step so far, over every expert of
    every block (empty without expert parallelism): the rows each expert received in all of the step's forwards.
    Collective over the expert-parallel group and, under pipelining, the pipeline (each stage holds its own
    blocks' experts)."""
    if getattr(run, "expert_mesh", None) is None:
        return {}
    import torch.distributed as dist

    # a step forwards each block once per microbatch. A pipeline stage's first step may forward one more, first:
    # torch's pipelining infers the shapes a stage sends by running it before the schedule (torch 2.13), on
    # inputs that are not the step's, so the step's reading is its last ``microbatches`` forwards
    m = run.ns.microbatches
    counts = [torch.stack(readings[-m:]).sum(0).reshape(-1)
              for _, readings in sorted(getattr(run, "expert_counts", {}).items())]
    group = run.expert_mesh["ep"].get_group()
    if counts:
        # every rank of an expert-parallel group holds the same blocks (one pipeline stage), so the same count
        mine = torch.cat(counts)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        mine = torch.cat(everyone)
        low_high = torch.stack([-mine.min(), mine.max()])
    else:  # no forward yet, or a stage without a mixture-of-experts block: no reading
        low_high = torch.full((2,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=run.device)
    if run.pipelined:  # the fewest and the most over every stage's blocks: one MAX of (-min, max)
        dist.all_reduce(low_high, op=dist.ReduceOp.MAX, group=run.mesh["pp"].get_group())
    if int(low_high[1]) == torch.iinfo(torch.int64).min:
        return {"tokens_per_expert_min": 0, "tokens_per_expert_max": 0}
    return {"tokens_per_expert_min": int(-low_high[0]), "tokens_per_expert_max": int(low_high[1])}


def load_text(record: Dict[str, int]) -> str:
    """``  tokens/expert 812..1344`` for the step line (empty without expert parallelism)."""
    if "tokens_per_expert_min" not in record:
        return ""
    return f"  tokens/expert {record['tokens_per_expert_min']}..{record['tokens_per_expert_max']}"

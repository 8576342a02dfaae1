"""The layouts of a world and the fastest that fits, with the runners-up and why they lost.

:func:`candidate_layouts` lists what people run on a cluster: pipeline stages (with virtual stages for the
interleaved schedules), data parallelism as FSDP2, HSDP (sharded inside a group of nodes, replicated across
them) or DDP, tensor parallelism inside a node with or without sequence parallelism, activation checkpointing
none / selective / full, and microbatches: gradient accumulation (``pp == 1``) or a pipeline's, so that
``local batch per microbatch x microbatches x dp == global batch``. For long sequences (from
:data:`LONG_SEQUENCE` tokens) it adds context parallelism (``cp`` of 2, 4 or 8 ranks inside a node, with the tp
ranks, where the sequence cuts into ``2 x cp`` chunks; with or without pipeline stages), and for a
mixture of experts expert parallelism (``ep`` dividing both the data-parallel shard group ``dp x cp`` and the
experts). :func:`choose_layout` estimates each (:func:`schedlang.autotune.step_cost.estimate_step`) and picks the
fastest that fits.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from .step_cost import CHECKPOINT_MODES, DP_MODES, GIB, Hardware, Layout, ModelShape, StepEstimate, estimate_step

__all__ = ["candidate_layouts", "choose_layout", "Choice", "RunnerUp", "divisors", "LONG_SEQUENCE"]

#: microbatch counts tried without a pipeline (gradient accumulation), as multiples
_ACCUMULATION = (1, 2, 4, 8, 16, 32, 64)
#: pipeline microbatches tried, as multiples of the stages (pp x stages per rank)
_PIPELINE_ROUNDS = (1, 2, 4)
#: context-parallel sizes tried
_CONTEXT_PARALLEL = (1, 2, 4, 8)
#: the sequence length from which context parallelism is tried: below it one sequence's activations fit a rank
#: with checkpointing even for 70B-class layers, and splitting it costs a K/V all-gather per layer and the fused
#: head and loss (which the trainer cannot run under cp) for no memory the run needs
LONG_SEQUENCE = 16384


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _hsdp_shards(dp: int, tp: int, gpus_per_node: int, fixed: Dict) -> List[int]:
    """Shard sizes tried for HSDP: those whose group fills 1, 2, 4 or 8 whole nodes (with the tp ranks)."""
    if fixed.get("dp_shard"):
        return [fixed["dp_shard"]] if dp % fixed["dp_shard"] == 0 and fixed["dp_shard"] < dp else []
    return [s for s in divisors(dp) if 1 < s < dp and s * tp in {gpus_per_node * k for k in (1, 2, 4, 8)}]


def _context_sizes(world: int, tp: int, per_node: int, seq: Optional[int], fixed: Dict) -> List[int]:
    """Context-parallel sizes tried: ``fixed["cp"]`` where given; else 1 and, for a sequence of at least
    :data:`LONG_SEQUENCE` tokens, 2, 4 and 8 where the sequence cuts into ``2 x cp`` chunks and the cp ranks
    with their tp ranks stay inside a node (its K/V all-gather runs every layer)."""
    if fixed.get("cp"):
        return [fixed["cp"]] if world % (tp * fixed["cp"]) == 0 else []
    if seq is None or seq < LONG_SEQUENCE:
        return [1]
    return [c for c in _CONTEXT_PARALLEL if world % (tp * c) == 0 and seq % (2 * c) == 0 and c * tp <= per_node]


def _expert_sizes(shape: ModelShape, data: int, shard: int, fixed: Dict) -> List[int]:
    """Expert-parallel sizes tried: dividing the experts and the ranks the experts' FSDP shards (``shard``) or,
    under DDP, the data-parallel ranks (``data = dp x cp``); 1 for a dense model."""
    group = shard if shard > 1 else data
    if shape.moe is None:
        return [1] if fixed.get("ep", 1) == 1 else []
    sizes = [e for e in divisors(group) if shape.moe.experts % e == 0]
    return [e for e in sizes if e == fixed["ep"]] if fixed.get("ep") else sizes


def candidate_layouts(shape: ModelShape, world: int, global_batch: int, base: Layout,
                      tp_sizes: Sequence[int], fixed: Optional[Dict] = None, max_bf16_reduce_ranks: int = 8,
                      gpus_per_node: Optional[int] = None, seq: Optional[int] = None) -> List[Layout]:
    """Every layout of ``world`` ranks that can run: ``tp`` among ``tp_sizes`` (and at most ``gpus_per_node``),
    whole sequences per dp rank and microbatch, at least one layer per stage; ``cp`` for sequences of ``seq``
    tokens from :data:`LONG_SEQUENCE` on, ``ep`` for a mixture of experts. ``base`` gives precision, speed-ups
    and the pipeline schedule; ``fixed`` the choices the user made (``pp``, ``dp``, ``tp``, ``cp``, ``ep``,
    ``dp_mode``, ``dp_replicate``, ``dp_shard``, ``reshard``, ``reduce_dtype``, ``activation_checkpoint``, ``sp``,
    ``optimize``, ``microbatches``, ``float8``) that every candidate keeps, and what the trainer can run:
    ``dp_modes`` and ``checkpoint_modes`` (all by default), ``selective_with_pipelines`` (False: selective
    checkpointing on pp=1 layouts only)."""
    fixed = dict(fixed or {})
    per_node = gpus_per_node or world
    out = []
    meshes = []
    for tp in tp_sizes:
        if world % tp or tp > per_node or fixed.get("tp", tp) != tp:
            continue
        for cp in _context_sizes(world, tp, per_node, seq, fixed):
            for pp in divisors(world // (tp * cp)):
                meshes.append((tp, cp, pp))
    for tp, cp, pp in meshes:
        dp = world // (tp * pp * cp)
        if pp > shape.layers or fixed.get("pp", pp) != pp or fixed.get("dp", dp) != dp:
            continue
        if (pp > 1 or cp > 1) and fixed.get("optimize"):  # optimize_model: one stage, whole sequences
            continue
        if fixed.get("sp") and tp < 2:
            continue
        v = 2 if pp > 1 and base.pp_schedule in ("Interleaved1F1B", "ZeroBubble") else 1
        if pp * v > shape.layers or global_batch % dp:
            continue
        rows = global_batch // dp
        if fixed.get("microbatches"):
            counts = [fixed["microbatches"]]
        elif pp > 1:
            counts = [pp * v * k for k in _PIPELINE_ROUNDS]
        else:
            counts = list(_ACCUMULATION)
        counts = [m for m in counts if rows % m == 0]
        modes = [fixed["dp_mode"]] if fixed.get("dp_mode") else (
            [m for m in ("fsdp", "hsdp", "ddp") if m in fixed.get("dp_modes", DP_MODES)] if dp * cp > 1
            else ["fsdp"])
        for mode in modes:
            replicas = [1]
            if mode == "hsdp":
                replicas = [dp // s for s in _hsdp_shards(dp, tp * cp, per_node, fixed)]
                if fixed.get("dp_replicate"):
                    replicas = [r for r in replicas if r == fixed["dp_replicate"]] or (
                        [fixed["dp_replicate"]] if dp % fixed["dp_replicate"] == 0
                        and 1 < fixed["dp_replicate"] < dp else [])
                if not replicas:
                    continue
            reshards = [True] if mode == "ddp" or dp * cp < 2 else (
                [False] if fixed.get("reshard") is False else [True, False])
            reduces = [fixed["reduce_dtype"]] if fixed.get("reduce_dtype") else (
                ["fp32", "bf16"] if dp * cp > 1 and base.dtype == "bf16" and dp * cp <= max_bf16_reduce_ranks
                else ["fp32"])
            checkpoints = ([fixed["activation_checkpoint"]] if fixed.get("activation_checkpoint")
                           else list(fixed.get("checkpoint_modes", CHECKPOINT_MODES)))
            sps = [True] if fixed.get("sp") else ([False, True] if tp > 1 else [False])
            if pp > 1 and fixed.get("selective_with_pipelines") is False:
                checkpoints = [c for c in checkpoints if c != "selective"]
            for r, e in [(r, e) for r in replicas for e in _expert_sizes(
                    shape, dp * cp, 1 if mode == "ddp" or dp * cp < 2 else dp // r * cp, fixed)]:
                for m in counts:
                    for reshard in reshards:
                        for reduce in reduces:
                            for ckpt in checkpoints:
                                for sp in sps:
                                    if e > 1 and tp > 1 and not sp:
                                        # spread experts run on each tp rank's sequence slice: ep beside tp
                                        # needs sequence parallelism
                                        continue
                                    out.append(dataclasses.replace(
                                        base, pp=pp, dp=dp, tp=tp, dp_mode=mode, dp_replicate=r, reshard=reshard,
                                        reduce_dtype=reduce, activation_checkpoint=ckpt, sp=sp, microbatches=m,
                                        stages_per_rank=v, optimize=base.optimize and pp == 1 and cp == 1,
                                        float8=bool(fixed.get("float8", base.float8)), cp=cp, ep=e))
    return out


@dataclasses.dataclass
class RunnerUp:
    """A layout that lost, and why: slower by ``slower_pct`` %, or over the memory by ``over_gib``."""

    estimate: StepEstimate
    why: str


@dataclasses.dataclass
class Choice:
    """The chosen layout's estimate, every candidate's (fastest first, those that fit first) and why."""

    best: StepEstimate
    ranked: List[StepEstimate]
    reason: str
    runners_up: List[RunnerUp] = dataclasses.field(default_factory=list)

    def runner_up(self) -> Optional[StepEstimate]:
        return next((e for e in self.ranked[1:] if e.fits), None)


def _rank_key(e: StepEstimate):
    # fitting layouts first, then the fastest; among equals the simpler (fewer pipeline and tensor ranks,
    # FSDP before HSDP before DDP, resharding kept, fp32 reduction, less recomputation, fewer microbatches)
    lay = e.layout
    return (not e.fits, round(e.step_s, 6) if e.fits else e.peak_bytes, lay.pp, lay.tp, lay.cp, lay.ep,
            ("fsdp", "hsdp", "ddp").index(lay.dp_mode), not lay.reshard, lay.reduce_dtype != "fp32",
            ("none", "selective", "full").index(lay.activation_checkpoint), lay.microbatches, lay.sp)


def choose_layout(shape: ModelShape, hw: Hardware, world: int, global_batch: int, seq: int,
                  base: Optional[Layout] = None, tp_sizes: Sequence[int] = (1,), fixed: Optional[Dict] = None,
                  candidates: Optional[List[Layout]] = None, runners_up: int = 4) -> Choice:
    """The fastest layout that fits the device's memory (by :func:`estimate_step`), a short reason and the best
    ``runners_up`` layouts of other meshes with why they lost."""
    base = base or Layout()
    layouts = candidates if candidates is not None else candidate_layouts(
        shape, world, global_batch, base, tp_sizes, fixed, gpus_per_node=hw.gpus_per_node, seq=seq)
    if not layouts:
        raise ValueError(f"no layout of {world} ranks fits global batch {global_batch} and the model "
                         f"({shape.layers} layers; tensor-parallel sizes {list(tp_sizes)})")
    ranked = sorted((estimate_step(shape, lay, hw, global_batch, seq) for lay in layouts), key=_rank_key)
    best = ranked[0]
    others = _runners_up(best, ranked, runners_up)
    return Choice(best, ranked, _reason(best, ranked, hw), others)


def _mesh_key(lay: Layout) -> Tuple:
    return (lay.pp, lay.dp, lay.tp, lay.cp, lay.ep, lay.dp_mode, lay.dp_replicate)


def _loss_reason(best: StepEstimate, e: StepEstimate) -> str:
    if not e.fits:
        what = "per rank" if e.total_bytes >= e.build_bytes else "per rank while building (the stage in fp32)"
        return (f"does not fit: {e.peak_bytes / GIB:.1f} GiB {what}, {(e.peak_bytes - e.memory_limit) / GIB:.1f} "
                f"GiB over the {e.memory_limit / GIB:.1f} GiB usable")
    slower = 100 * (e.step_s / best.step_s - 1)
    parts = {"compute": e.compute_s - best.compute_s, "exposed communication": e.comm_exposed_s - best.comm_exposed_s,
             "pipeline bubble": e.bubble_s - best.bubble_s, "optimizer step": e.optimizer_s - best.optimizer_s}
    what, delta = max(parts.items(), key=lambda kv: kv[1])
    cause = f" (mostly {what}: +{1e3 * delta:,.0f} ms)" if delta > 0 else ""
    return f"slower by {slower:.1f}%{cause}"


def _runners_up(best: StepEstimate, ranked: List[StepEstimate], count: int) -> List[RunnerUp]:
    """The best layout of each other mesh (pp, dp, tp, data-parallel engine): fitting ones first, then those
    that come closest to fitting."""
    seen = {_mesh_key(best.layout)}
    fitting, not_fitting = [], []
    for e in ranked[1:]:
        key = _mesh_key(e.layout)
        if key in seen:
            continue
        seen.add(key)
        (fitting if e.fits else not_fitting).append(e)
    chosen = fitting[:count]
    chosen += sorted(not_fitting, key=lambda e: e.peak_bytes)[:max(0, count - len(chosen))]
    if len(chosen) < count:  # a small world: other options of the same mesh
        chosen += [e for e in ranked[1:] if e not in chosen and e.layout != best.layout][:count - len(chosen)]
    return [RunnerUp(e, _loss_reason(best, e)) for e in chosen]


def _alternative(best: StepEstimate, ranked: List[StepEstimate], **changes) -> Optional[StepEstimate]:
    target = dataclasses.replace(best.layout, **changes)
    return next((e for e in ranked if e.layout == target), None)


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:,.0f} ms"


def _without(best: StepEstimate, ranked: List[StepEstimate], what: str) -> str:
    """How the best layout without ``what`` (cp or ep) compares: slower by how much, or over the memory."""
    other = next((e for e in ranked if getattr(e.layout, what) == 1), None)
    if other is None:
        return f"no layout without {what} was a candidate"
    if not other.fits:
        return f"without it no layout fits (the closest, {other.layout.describe()}, needs {other.peak_bytes / GIB:.1f} GiB)"
    return f"the best without it, {other.layout.describe()}, is {_ms(other.step_s - best.step_s)} slower"


def _split_reasons(best: StepEstimate, ranked: List[StepEstimate]) -> List[str]:
    """Why the chosen layout splits sequences (cp) or experts (ep), and the load-imbalance assumption of ep."""
    lay, parts = best.layout, []
    if lay.cp > 1:
        parts.append(f"context parallelism cp={lay.cp}: each rank holds 1/{lay.cp} of every sequence's activations "
                     f"and all-gathers keys and values per layer; {_without(best, ranked, 'cp')}")
    if lay.ep > 1 and best.moe:
        a2a = next((c for c in best.collectives if c.group == "ep"), None)
        parts.append(f"expert parallelism ep={lay.ep}: {best.moe['experts_per_rank']} of {best.moe['experts']} experts "
                     f"per rank, tokens dispatched and combined by all-to-all"
                     + (f" ({a2a.link}, {_ms(a2a.seconds)})" if a2a else "")
                     + f", assuming the busiest rank receives {best.moe['load_imbalance']:.2f}x the mean tokens; "
                     f"{_without(best, ranked, 'ep')}")
    return parts


def _reason(best: StepEstimate, ranked: List[StepEstimate], hw: Hardware) -> str:
    lay = best.layout
    parts = []
    mem = f"{best.peak_bytes / GIB:.1f} of {hw.memory_bytes / GIB:.0f} GiB per rank"
    if not best.fits:
        parts.append(f"no layout fits the estimated memory: this one needs the least ({mem})")
    else:
        parts.append(mem)
    others = []
    seen = {(lay.pp, lay.dp, lay.tp, lay.cp, lay.ep)}
    for e in ranked[1:]:
        key = (e.layout.pp, e.layout.dp, e.layout.tp, e.layout.cp, e.layout.ep)
        if key not in seen and e.fits:
            seen.add(key)
            others.append(e.layout.describe().split(" (")[0] + f" {_ms(e.step_s)}")
    if others:
        parts.append(f"est. {_ms(best.step_s)}/step against {', '.join(others[:3])}")
    parts += _split_reasons(best, ranked)
    if lay.dp > 1:
        if lay.dp_mode == "fsdp":
            ddp = _alternative(best, ranked, dp_mode="ddp", reshard=True)
            if ddp is not None:
                parts.append(f"FSDP2 shards the optimizer step and state ({_ms(ddp.step_s - best.step_s)} less than "
                             "DDP)" if ddp.fits else "FSDP2: DDP does not fit")
        if lay.dp_mode in ("fsdp", "hsdp"):
            if not lay.reshard:
                parts.append("no resharding: the gathered weights fit, one all-gather per layer instead of two")
            else:
                alt = _alternative(best, ranked, reshard=False)
                if alt is not None and not alt.fits:
                    parts.append("resharding after forward: keeping the gathered weights would not fit")
        if lay.dp_mode == "hsdp":
            parts.append(f"HSDP: weights sharded over {lay.dp_shard} ranks inside a node group, gradients summed "
                         f"over {lay.dp_replicate} replicas once per step")
        if lay.reduce_dtype == "bf16":
            parts.append(f"bf16 gradient reduction: half the bytes over {lay.dp} ranks")
    if lay.recomputes:
        alt = _alternative(best, ranked, activation_checkpoint="none")
        if alt is not None and not alt.fits:
            parts.append(f"{lay.activation_checkpoint} activation checkpointing: without it "
                         f"{alt.peak_bytes / GIB:.1f} GiB would not fit")
    if lay.pp == 1 and lay.microbatches > 1:
        alt = _alternative(best, ranked, microbatches=1)
        if alt is not None and not alt.fits:
            parts.append(f"{lay.microbatches} accumulation steps of {best.global_batch // (lay.dp * lay.microbatches)} "
                         f"sequence(s): the whole local batch at once would not fit")
    parts.append(f"interconnect {hw.describe_links()}")
    return "; ".join(parts)

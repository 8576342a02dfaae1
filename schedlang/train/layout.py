"""The layout of a run, explained before it starts: the model's facts read on the meta device, the
devices and their link, ``--layout auto``'s choice (the autotune cost model,
:mod:`schedlang.autotune.training_cost`) and the plan block that ``--dry-run`` prints and every run
opens with."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from typing import Any, Dict, List, Optional

import torch

from ..autotune.moe_cost import count_expert_params, moe_shape
from ..autotune.training_cost import (GIB, Choice, Hardware, Layout, ModelShape, StepEstimate, choose_layout,
                                      estimate_json, estimate_step, format_estimate)
from .configs import Dims, build_meta_model, head_dim, model_config, model_dims, valid_tp_sizes, validate_model
from .experts import check_expert_counts, count_experts
from .flags import TOY_GLOBAL_BATCH, TOY_SEQ, _device_type, _fail, validate_layout
from .structure import decoder_layers, embedding_params, flops_params, is_tied, tensor_parallel_problem

logger = logging.getLogger("schedlang.train")


@dataclasses.dataclass
class ModelFacts:
    """What the run needs to know of its model before building it, read off the meta-device model."""

    cfg: Any
    dims: Dims
    shape: ModelShape
    layers_path: str
    n_params: int
    tp_problem: Optional[str] = None
    #: experts per mixture-of-experts block (None: a dense model), for --ep
    experts: Optional[int] = None


def model_facts(ns: argparse.Namespace, check_tensor_parallel: bool = False) -> ModelFacts:
    """The config of ``--model`` / ``--config`` and the facts of its model (built on the meta device: no memory
    for weights); sets ``ns.model`` to the config's family."""
    cfg = model_config(ns.model, ns.config)
    ns.model = cfg.model_type
    dims = model_dims(cfg)
    if dims.heads is None or dims.heads < 1 or (getattr(cfg, "head_dim", None) is None and dims.hidden % dims.heads):
        _fail(f"--config {ns.config}: the hidden size {dims.hidden} must be divisible by the number of attention "
              f"heads ({dims.heads}, at least 1)")
    meta = build_meta_model(cfg)
    path, layers = decoder_layers(meta, f"--config {ns.config}")
    if len(layers) != dims.layers:
        logger.info("%s: the config says %d layers, the model holds %d", ns.config, dims.layers, len(layers))
        dims.layers = len(layers)
    first = layers[0]
    gated = sum(1 for m in first.modules() if isinstance(m, torch.nn.Linear)) >= 7 or any(
        "gate" in n for n, _ in first.named_modules())
    n_params = sum(p.numel() for p in meta.parameters())
    moe = moe_shape(cfg, dims.layers, count_expert_params(meta))
    used = flops_params(meta)
    if moe is not None:  # a token's matmuls use top_k of the routed experts
        used = used - moe.expert_params + round(moe.active_expert_params)
    shape = ModelShape(layers=dims.layers, hidden=dims.hidden, heads=dims.heads, kv_heads=dims.kv_heads,
                       head_dim=head_dim(cfg, dims), intermediate=dims.intermediate, vocab=dims.vocab,
                       params=n_params, flops_params=used, embedding_params=embedding_params(meta),
                       gated_mlp=gated, tied=is_tied(meta), moe=moe)
    problem = tensor_parallel_problem(meta) if check_tensor_parallel else None
    return ModelFacts(cfg, dims, shape, path, n_params, problem, count_experts(meta))


def check_model_layout(ns: argparse.Namespace, facts: ModelFacts) -> None:
    """The layout of ``ns`` against the model: every refusal before a weight is allocated."""
    validate_model(ns, facts.dims, facts.cfg)
    check_expert_counts(ns, facts.experts)
    if ns.tp > 1 and facts.tp_problem:
        _fail(f"--tp {ns.tp}: {facts.cfg.model_type} models cannot be split by tensor parallelism here: "
              f"{facts.tp_problem}; use --tp 1 (data or pipeline parallelism)")


# ------------------------------------------------------------------------------------------------ devices
def hardware(ns: argparse.Namespace, world: int, link_bytes_per_s: Optional[float] = None) -> Hardware:
    """The devices of the run: each GPU's name and memory (``--gpu-memory-gib`` overrides), the nodes
    (``--nodes`` x ``--gpus-per-node``) and the links: ``--intra-node-gbps`` / ``--inter-node-gbps`` (or the
    deprecated ``--link-gbps``) where given, else measured (``link_bytes_per_s``, an all-reduce over every rank:
    the network's figure when the ranks span nodes), else nominal figures."""
    device = _device_type(ns)
    name = ""
    memory = ns.gpu_memory_gib
    if device == "cuda" and torch.cuda.is_available():
        # this rank's GPU by its index, before the rank has set its device (and without using another's)
        index = int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())
        props = torch.cuda.get_device_properties(index)
        name = props.name
        memory = memory if memory is not None else props.total_memory / GIB
    hw = Hardware.nominal(device, name=name, memory_gib=memory, link_gbps=ns.link_gbps, world=world,
                          intra_gbps=getattr(ns, "intra_node_gbps", None), inter_gbps=getattr(ns, "inter_node_gbps", None),
                          gpus_per_node=getattr(ns, "gpus_per_node", None))
    measured_is_given = hw.inter_source == "given" if hw.nodes > 1 else hw.link_source == "given"
    if link_bytes_per_s is not None and not measured_is_given:
        hw = hw.with_link(link_bytes_per_s, "measured")
    return hw


def measure_link(device: torch.device, world: int, megabytes: Optional[int] = None, iters: int = 5) -> float:
    """The bus bandwidth (bytes/s) of an all-reduce over every rank, the same figure on all of them (the slowest
    rank's time). Called by every rank once the process group is up."""
    import torch.distributed as dist

    size = (megabytes or (64 if device.type == "cuda" else 4)) * 2**20
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    buf = torch.ones(size // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, device=device)
    for _ in range(2):  # the first calls set up the communicator
        dist.all_reduce(buf)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64 if device.type == "cpu"
                           else torch.float32, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return 2 * (world - 1) / world * size / max(float(elapsed), 1e-9)


# ------------------------------------------------------------------------------------------------ layouts
#: the data-parallel engines and checkpointing modes the trainer runs (a dry run plans with every one): selective
#: checkpointing wraps the whole model's layers, so pp=1 only
TRAINER_RUNS = {"dp_modes": ("fsdp", "hsdp", "ddp"), "checkpoint_modes": ("none", "selective", "full"),
                "selective_with_pipelines": False}


def base_layout(ns: argparse.Namespace) -> Layout:
    """Precision, speed-ups and pipeline schedule of the run (the parts a layout choice keeps)."""
    cuda = _device_type(ns) == "cuda"
    return Layout(dtype=ns.dtype, optimize=bool(ns.optimize) if ns.optimize is not None else cuda,
                  compiled=bool(ns.compile), optimizer=ns.optimizer, pp_schedule=ns.pp_schedule,
                  float8=bool(getattr(ns, "float8", False)))


def fixed_choices(ns: argparse.Namespace) -> Dict[str, Any]:
    """What the user decided among the things ``--layout auto`` chooses: kept by every candidate."""
    fixed: Dict[str, Any] = {}
    if ns.dp_mode is not None:
        fixed["dp_mode"] = ns.dp_mode
    if ns.no_reshard:
        fixed["reshard"] = False
    if ns.reduce_dtype is not None:
        fixed["reduce_dtype"] = ns.reduce_dtype
    if ns.activation_checkpoint:
        fixed["activation_checkpoint"] = ns.activation_checkpoint
    if ns.sp:
        fixed["sp"] = True
    if ns.optimize:
        fixed["optimize"] = True
    if ns.microbatches is not None:
        fixed["microbatches"] = ns.microbatches
    if getattr(ns, "float8", False):
        fixed["float8"] = True
    if getattr(ns, "ep", None):
        fixed["ep"] = ns.ep
    elif not ns.dry_run and not hasattr(ns, "ep"):  # a trainer without expert parallelism runs ep=1 only
        fixed["ep"] = 1
    if not ns.dry_run:  # a launched run chooses among what the trainer runs
        fixed.update(TRAINER_RUNS)
    return fixed


def layout_of(ns: argparse.Namespace) -> Layout:
    """The layout ``ns`` runs (after validation)."""
    return dataclasses.replace(base_layout(ns), pp=ns.pp, dp=ns.dp, tp=ns.tp, dp_mode=ns.dp_mode,
                               dp_replicate=getattr(ns, "dp_replicate", None) or 1, reshard=not ns.no_reshard,
                               reduce_dtype=ns.reduce_dtype, activation_checkpoint=ns.activation_checkpoint or "none",
                               sp=ns.sp, microbatches=ns.microbatches, stages_per_rank=ns.stages_per_rank,
                               optimize=bool(ns.optimize), cp=getattr(ns, "cp", None) or 1,
                               ep=getattr(ns, "ep", None) or 1)


def choose(ns: argparse.Namespace, facts: ModelFacts, hw: Hardware, world: int) -> Choice:
    """``--layout auto``: the fastest layout that fits, by the cost model."""
    if not hasattr(ns, "_auto_fixed"):  # the user's own choices, before any choice of ours is written into ns
        ns._auto_fixed = fixed_choices(ns)
    limit = min(world, hw.gpus_per_node)  # tensor parallelism stays inside a node
    tp_sizes = [t for t in valid_tp_sizes(facts.dims, limit) if world % t == 0 and (t == 1 or not facts.tp_problem)]
    try:
        choice = choose_layout(facts.shape, hw, world, ns.global_batch, ns.seq, base=base_layout(ns),
                               tp_sizes=tp_sizes, fixed=ns._auto_fixed)
    except ValueError as e:
        _fail(f"--layout auto: {e}; give --global-batch a multiple of the world size {world}, or a layout with "
              "--dp/--tp/--pp")
    ns._auto_choice = choice
    return choice


def apply_layout(ns: argparse.Namespace, layout: Layout, world: int) -> None:
    """Write a chosen layout into the flags and check it as a given one would be."""
    ns.pp, ns.dp, ns.tp, ns.cp = layout.pp, layout.dp, layout.tp, layout.cp
    if layout.ep > 1 or hasattr(ns, "ep"):
        ns.ep = layout.ep
    ns.dp_mode = layout.dp_mode
    ns.dp_replicate, ns.dp_shard = (layout.dp_replicate, layout.dp_shard) if layout.dp_mode == "hsdp" else (None, None)
    ns.no_reshard = layout.dp > 1 and layout.dp_mode in ("fsdp", "hsdp") and not layout.reshard
    ns.reduce_dtype = layout.reduce_dtype
    ns.activation_checkpoint = None if layout.activation_checkpoint == "none" else layout.activation_checkpoint
    ns.sp = layout.sp
    fixed = getattr(ns, "_auto_fixed", {})
    # the chosen microbatches: accumulation steps the search found the batch needs, or a pipeline's
    ns.microbatches = fixed.get("microbatches") or layout.microbatches
    ns._microbatches_given = ns.microbatches
    if not fixed.get("optimize"):
        ns.optimize = None  # the default again: on a GPU where the layout lets it
    validate_layout(ns, world)


def choice_block(choice: Choice) -> str:
    """``--layout auto``'s choice and its reasons, and the runners-up with why each lost."""
    lines = [f"schedlang train: --layout auto chose {choice.best.layout.describe()}", f"  why: {choice.reason}"]
    for r in choice.runners_up:
        lines.append(f"  runner-up: {r.estimate.layout.describe()}: {r.why} ({r.estimate.peak_bytes / GIB:.1f} GiB, "
                     f"{1e3 * r.estimate.step_s:,.0f} ms/step)")
    return "\n".join(lines)


def toy_size_warning(ns: argparse.Namespace, facts: ModelFacts) -> Optional[str]:
    """A warning where --global-batch / --seq were left at their smoke-test defaults for a model over 1B
    parameters: a plan for 8 sequences of 64 tokens says little about a real run."""
    left = getattr(ns, "toy_defaults", [])
    if facts.n_params <= 1e9 or not left:
        return None
    return (f"{' and '.join(left)} left at the smoke-test default(s) (global batch {TOY_GLOBAL_BATCH}, seq "
            f"{TOY_SEQ}) for a {facts.n_params / 1e9:,.1f}B-parameter model: give the run's real --global-batch and "
            f"--seq (e.g. --global-batch 256 --seq 8192) for a meaningful plan")


def estimate(ns: argparse.Namespace, facts: ModelFacts, hw: Hardware) -> StepEstimate:
    return estimate_step(facts.shape, layout_of(ns), hw, ns.global_batch, ns.seq)


def plan_block(ns: argparse.Namespace, facts: ModelFacts, hw: Hardware, world: int) -> str:
    """The block ``--dry-run`` prints and every run opens with."""
    e = estimate(ns, facts, hw)
    speed = [ns.dtype, "compile" if ns.compile else "eager", "optimize_model" if ns.optimize else "",
             ns.optimizer]
    header = (f"schedlang train plan: {ns.model} {ns.config} ({facts.n_params / 1e6:,.1f}M parameters, "
              f"{facts.dims.layers} layers, hidden {facts.dims.hidden}), global batch {ns.global_batch} x {ns.seq} "
              f"tokens, {world} rank(s) on {_device_type(ns)}")
    text = format_estimate(e, hw, header=header, extras=", ".join(s for s in speed if s))
    warning = toy_size_warning(ns, facts)
    if warning:
        text += f"\n  warning     {warning}"
    if ns.dry_run and getattr(ns, "json", None):
        write_plan_json(ns, facts, hw, world, e)
    return text


def write_plan_json(ns: argparse.Namespace, facts: ModelFacts, hw: Hardware, world: int, e: StepEstimate) -> None:
    """``--dry-run --json FILE``: the plan of ``plan_block`` as JSON (with ``--layout auto``'s runners-up)."""
    import json

    choice = getattr(ns, "_auto_choice", None)
    extra = {"model": {"family": ns.model, "config": ns.config, "params": facts.n_params,
                       "layers": facts.dims.layers, "hidden": facts.dims.hidden},
             "world": world, "chosen_by": "auto" if choice is not None else "flags",
             "warnings": [w for w in [toy_size_warning(ns, facts)] if w]}
    if choice is not None:
        extra["why"] = choice.reason
    extra.update(getattr(ns, "_traced_json", {}))  # --trace-memory: the peak rank's traced step
    data = estimate_json(e, hw, runners_up=choice.runners_up if choice is not None else [], extra=extra)
    with open(ns.json, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def probe_candidates(choice: Choice, count: int = 2) -> List[Layout]:
    """The ``count`` best distinct layouts that fit (for ``--probe``)."""
    out: List[Layout] = []
    for e in choice.ranked:
        if e.fits and e.layout not in out:
            out.append(e.layout)
        if len(out) == count:
            break
    return out or [choice.best.layout]

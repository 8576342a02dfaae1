"""The trainer's flags: the parser and every check that needs no process group."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from pathlib import Path
from typing import Optional

import torch

from ..errors import SchedlangError
from ..utils.paths import nearest_existing, refuses_new_files

logger = logging.getLogger("schedlang.train")

#: families with the presets --config tiny / 1b (any other family comes from a config.json)
MODELS = ("llama", "gpt2")
PP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "ZeroBubble")
OPTIMIZERS = ("adamw", "fused-adamw", "sgd")
CHECKPOINT_MODES = ("selective", "full")
#: the defaults of --global-batch and --seq: sizes for a quick run, not for planning a large model
TOY_GLOBAL_BATCH = 8
TOY_SEQ = 64


class TrainError(SchedlangError, ValueError):
    """A trainer flag, file or layout that cannot work; the message says what would."""


# ------------------------------------------------------------------------------------------------ flags
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends a flag's default to its help, unless the help already says it or the flag is off (or unset) by
    default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """An unknown flag or a value of the wrong type reads as one line, not the whole usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; {self.prog} --help lists every flag\n")


#: where ``--trace-memory`` runs the peak rank: on fake tensors (anywhere), or for real on this machine's GPU
TRACE_MODES = ("fake", "gpu")


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = _Parser(
        prog=prog or "schedlang train",
        description="Train a HF causal LM (any family transformers' AutoModelForCausalLM builds: LLaMA, Qwen, "
                    "Mistral, Gemma, Phi-3, OPT, GPT-2 ...) with tensor, sequence, data and pipeline parallelism "
                    "written as schedules. Run under torchrun, or spawn local ranks with --nproc N. On a GPU the "
                    "defaults are the fastest measured path (bf16, per-layer compile, optimize_model, fused AdamW) "
                    "and, on several GPUs, a layout chosen from the model, the GPUs' memory and the interconnect.",
        formatter_class=_HelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, help=f"model family: with --config tiny / 1b one of "
                   f"{', '.join(MODELS)} (default: llama); with a config.json its model_type (checked)")
    m.add_argument("--config", default=None,
                   help="'tiny' (hidden 64, 4 layers, vocab 256), '1b' (LLaMA-1.1B; GPT-2 medium for gpt2), the "
                        "LLaMA-3 sizes '8b', '70b', '405b' (for planning with --dry-run) or the path of a HF config.json of any causal-LM family, or its directory (default: tiny, or the "
                        "config.json of --init-from)")
    m.add_argument("--init-from", default=None, metavar="DIR",
                   help="fine-tune: start from the weights of a HF safetensors checkpoint (a directory written by "
                        "save_pretrained or --export-hf); each rank reads only its shards")
    m.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                   help="bf16: mixed precision (fp32 master weights; bf16 compute via FSDP2's policy or autocast) "
                        "(default: bf16 on a GPU, fp32 on the CPU)")
    m.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile every transformer layer (default: on a GPU)")
    m.add_argument("--optimize", action=argparse.BooleanOptionalAction, default=None,
                   help="schedlang.models.optimize_model: fused norms, the LM head fused with the loss (so the full "
                        "logits never exist; tp=1), the fastest measured attention backend, and with --compile its "
                        "per-layer compile; pp=1 layouts (default: on a GPU, where the layout has pp=1)")
    m.add_argument("--activation-checkpoint", nargs="?", const="full", default=None, choices=CHECKPOINT_MODES,
                   help="full (the bare flag): each layer keeps only its input and is recomputed in the backward; "
                        "selective: inside each layer every other matmul's output and attention's output are saved, "
                        "the rest recomputed (torch.utils.checkpoint's selective policy) (default: off, or as "
                        "--layout auto chooses where memory needs it)")
    m.add_argument("--float8", action="store_true",
                   help="train the decoder layers' Linears in float8 (torchao, tensorwise scales; H100-class GPUs): "
                        "the estimate runs their GEMMs at twice the bf16 rate")
    lay = p.add_argument_group("layout (world size = pp x dp x cp x tp; dp = dp-replicate x dp-shard)")
    lay.add_argument("--layout", default=None, choices=["auto"],
                     help="auto: choose pp x dp x tp, FSDP2 or DDP, resharding, the reduce dtype and activation "
                          "checkpointing from the model's size, the GPUs' memory and the measured interconnect "
                          "(default when none of --dp/--tp/--pp is given and the run has several ranks)")
    lay.add_argument("--probe", action="store_true",
                     help="with --layout auto: time the two best layouts for a few steps and keep the faster")
    lay.add_argument("--dp", type=int, default=None, help="data-parallel ranks (default 1 unless --layout auto)")
    lay.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (default 1 unless --layout auto)")
    lay.add_argument("--pp", type=int, default=None, help="pipeline stages (ranks) (default 1 unless --layout auto)")
    lay.add_argument("--cp", type=int, default=None,
                     help="context-parallel ranks: each holds 1/cp of every sequence (load-balanced for causal "
                          "attention) and all-gathers keys and values per layer; --seq must be a multiple of 2 x cp")
    lay.add_argument("--ep", type=int, default=None,
                     help="expert-parallel ranks, carved from the data-parallel ones (--dp, x --cp): each holds "
                          "1/ep of every mixture-of-experts block's experts, tokens reach them by all-to-all; "
                          "must divide --dp x --cp and the number of experts (default 1)")
    lay.add_argument("--sp", action="store_true", help="sequence parallelism on the tp ranks")
    lay.add_argument("--dp-mode", default=None, choices=["fsdp", "hsdp", "ddp"],
                     help="FSDP2 (fully_shard), HSDP (FSDP2 sharded over --dp-shard ranks, replicated over "
                          "--dp-replicate) or DDP (replicate) on the dp ranks (default: fsdp, or as --layout auto "
                          "chooses)")
    lay.add_argument("--dp-replicate", type=int, default=None,
                     help="HSDP: replicas of the sharded model (usually across nodes); with --dp-shard, --dp = "
                          "dp-replicate x dp-shard")
    lay.add_argument("--dp-shard", type=int, default=None, help="HSDP: ranks each replica's weights are sharded over "
                     "(usually inside a node)")
    lay.add_argument("--reduce-dtype", default=None, choices=["fp32", "bf16"],
                     help="with --dtype bf16 and --dp >= 2: the dtype the gradients are summed in over the dp ranks "
                          "(bf16: half the bytes of fp32; the sum is rounded to bf16 once) (default: fp32, or as "
                          "--layout auto chooses)")
    lay.add_argument("--no-reshard", action="store_true",
                     help="with --dp-mode fsdp: each layer keeps its gathered weights from its forward to its backward "
                          "(one all-gather per layer and step instead of two, for the memory of the whole model)")
    lay.add_argument("--pp-schedule", default="1F1B", help=f"pipeline schedule: {', '.join(PP_SCHEDULES)}")
    lay.add_argument("--stages-per-rank", type=int, default=None,
                     help="pipeline stages each pp rank holds (default 2 for Interleaved1F1B / ZeroBubble, else 1)")
    lay.add_argument("--microbatches", type=int, default=None,
                     help="microbatches per step (default: pp x stages-per-rank with pipelining, else 1: with pp=1 "
                          "they are accumulated)")
    lay.add_argument("--nproc", type=int, default=None, help="spawn this many local ranks (without torchrun)")
    lay.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    lay.add_argument("--timeout", type=float, default=1800.0,
                     help="seconds a collective may wait before the run fails")
    lay.add_argument("--gpu-memory-gib", type=float, default=None, metavar="GIB",
                     help="for --layout auto and --dry-run: the memory of each device (default: read from the GPU)")
    lay.add_argument("--nodes", type=int, default=None,
                     help="nodes of the cluster (world = nodes x gpus-per-node): any size with --dry-run; a launched "
                          "run must have that many ranks (default: from torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE, or "
                          "the ranks of --nproc over nodes of 8 GPUs for --dry-run)")
    lay.add_argument("--gpus-per-node", type=int, default=None,
                     help="GPUs of each node (default: torchrun's LOCAL_WORLD_SIZE; 8 for --dry-run, an HGX node)")
    lay.add_argument("--intra-node-gbps", type=float, default=None, metavar="GB/S",
                     help="for --layout auto and --dry-run: bandwidth per direction between the GPUs of a node "
                          "(default: measured by the ranks; nominal 450, NVLink 4)")
    lay.add_argument("--inter-node-gbps", type=float, default=None, metavar="GB/S",
                     help="for --layout auto and --dry-run: network bandwidth per GPU between nodes (default: "
                          "measured by the ranks; nominal 50, one 400 Gb/s InfiniBand port per GPU)")
    lay.add_argument("--link-gbps", type=float, default=None, metavar="GB/S",
                     help="deprecated: sets both --intra-node-gbps and --inter-node-gbps")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=10, help="steps of the run (the learning-rate schedule spans them)")
    t.add_argument("--stop-after", type=int, default=None, help="stop after this step, saved in --checkpoint-dir (continue later with --resume)")
    t.add_argument("--global-batch", type=int, default=None,
                   help=f"sequences per step over all dp ranks (default: {TOY_GLOBAL_BATCH}, a smoke-test size)")
    t.add_argument("--seq", type=int, default=None,
                   help=f"tokens per sequence (default: {TOY_SEQ}, a smoke-test size)")
    t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    t.add_argument("--lr-schedule", default="cosine", choices=["cosine", "constant"],
                   help="after warmup: cosine decay to 10%% of --lr, or constant")
    t.add_argument("--warmup", type=int, default=0, help="linear warmup steps")
    t.add_argument("--weight-decay", type=float, default=0.1, help="the optimizer's weight decay")
    t.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    t.add_argument("--optimizer", default=None, help="adamw (torch.optim.AdamW), fused-adamw (schedlang's fused "
                   "Triton AdamW), sgd (torch.optim.SGD, momentum 0.9) (default: fused-adamw on a GPU, adamw on "
                   "the CPU)")
    t.add_argument("--seed", type=int, default=0,
                   help="seed of the initial weights (without --init-from), the batches (synthetic tokens, or where "
                        "sequences start in --data) and dropout")
    t.add_argument("--data", default="synthetic", help="'synthetic'; a .npy / raw .bin file of token ids "
                   "(.bin: uint16 if the vocabulary is < 65536, else uint32); or text: a .jsonl file (a 'text' "
                   "field per line), a .txt file (one document) or a directory of them, with --tokenizer")
    t.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="for text --data / --eval-data: a tokenizer directory AutoTokenizer.from_pretrained loads "
                        "offline; the text is tokenized once into a token cache beside the data")
    t.add_argument("--eval-data", default=None, help="held-out data (the formats of --data): its loss is logged as "
                   "eval_loss every --eval-every steps")
    t.add_argument("--eval-every", type=int, default=0, help="steps between evaluations on --eval-data (0: only at "
                   "the end)")
    t.add_argument("--eval-batches", type=int, default=4, help="global batches of --eval-data per evaluation")
    io = p.add_argument_group("checkpoints and output")
    io.add_argument("--checkpoint-dir", default=None, help="directory of distributed checkpoints (step-NNNNNNNN/); a new run needs one "
                    "that holds none (--resume continues the run whose checkpoints it holds)")
    io.add_argument("--save-every", type=int, default=0, help="save a checkpoint every K steps (0: only at the end)")
    io.add_argument("--resume", action="store_true",
                    help="continue from the newest complete checkpoint in --checkpoint-dir (skipping damaged ones), or "
                         "start fresh if it holds none: the same command line serves a first start and every restart "
                         "(one after the last step's save exits 0 with nothing to do)")
    io.add_argument("--async-save", action="store_true",
                    help="write checkpoints in the background (torch.distributed.checkpoint.async_save) while training "
                         "goes on; each becomes visible once written, and the run waits for the last one")
    io.add_argument("--export-hf", default=None, metavar="DIR", help="write the trained model as a HF model here")
    io.add_argument("--metrics", default=None, metavar="FILE", help="append one JSON line per step to FILE")
    io.add_argument("--log-every", type=int, default=1, help="print progress every K steps")
    io.add_argument("--tensorboard", default=None, metavar="DIR",
                    help="write loss, eval loss, tokens/s, MFU, memory and learning rate as TensorBoard scalars "
                         "here (needs the tensorboard package: pip install 'schedlang[tensorboard]')")
    io.add_argument("--plot", default=None, metavar="FILE.png",
                    help="at the end, draw the loss and throughput curves into this PNG (needs matplotlib)")
    io.add_argument("--dry-run", action="store_true",
                    help="print the layout, the memory per rank, the collectives per step and the estimated step "
                         "time, building the model on the meta device only; then exit")
    io.add_argument("--json", default=None, metavar="FILE",
                    help="with --dry-run: write the plan as JSON here (layout degrees, peak GiB of the largest rank, "
                         "step time, tokens/s, the collectives with bytes and link, the runners-up)")
    io.add_argument("--trace-memory", nargs="?", const="fake", default=None, choices=TRACE_MODES,
                    help="with --dry-run: also build the peak rank of the run with a fake process group of the "
                         "planned world and run real training steps, printing its peak beside the formula's. "
                         "'fake' (the bare flag): on fake tensors under torch's memory tracker, eager, no GPU, "
                         "nothing allocated. 'gpu': for real on this machine's GPU, as the run would (torch.compile, "
                         "float8 and the fused kernels included), reading the caching allocator's peak allocated "
                         "and reserved memory")
    return p


def _fail(msg: str) -> None:
    raise TrainError(msg)


def _world_from_env() -> Optional[int]:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def _resolve_init_from(ns: argparse.Namespace) -> None:
    """``--config`` from ``--init-from``'s config.json where it is not given (its model_type names the family)."""
    if ns.init_from is not None:
        directory = Path(ns.init_from)
        if not directory.is_dir():
            _fail(f"--init-from {ns.init_from!r}: no such directory (expected a HF checkpoint directory holding "
                  f"config.json and model.safetensors, as save_pretrained or --export-hf write it)")
        if not any(directory.glob("*.safetensors")) and not (directory / "model.safetensors.index.json").is_file():
            _fail(f"--init-from {ns.init_from}: the directory holds no .safetensors file (expected model.safetensors, "
                  "or model.safetensors.index.json with the files it names, as save_pretrained or --export-hf write "
                  "them; a PyTorch .bin checkpoint can be converted with transformers' save_pretrained)")
        if ns.config is None:
            if not (directory / "config.json").is_file():
                _fail(f"--init-from {ns.init_from}: it has no config.json; give the model's config with --config")
            ns.config = str(directory)
    ns.config = ns.config or "tiny"


def layout_given(ns: argparse.Namespace) -> bool:
    return any(getattr(ns, k, None) is not None for k in ("dp", "tp", "pp", "cp", "dp_replicate", "dp_shard"))


def _positive(ns: argparse.Namespace, *flags: str) -> None:
    for flag in flags:
        value = getattr(ns, flag)
        if value is not None and (not value > 0 or not math.isfinite(value)):
            _fail(f"--{flag.replace('_', '-')} must be a positive number, got {value}")


def resolve_cluster(ns: argparse.Namespace, world: int) -> int:
    """The nodes and GPUs per node of the run (``ns.nodes``, ``ns.gpus_per_node``) and its world size.

    ``--nodes N --gpus-per-node G`` describe a cluster of N x G ranks: with ``--dry-run`` the plan is for that
    world, whatever runs here; a launched run must have N x G ranks. Under torchrun the node's size is
    LOCAL_WORLD_SIZE; ``--nproc`` ranks are one node, except in a dry run, which plans for nodes of 8 GPUs."""
    for flag in ("nodes", "gpus_per_node"):
        value = getattr(ns, flag)
        if value is not None and value < 1:
            _fail(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    _positive(ns, "intra_node_gbps", "inter_node_gbps", "link_gbps")
    if ns.link_gbps is not None:
        given = [f"--{f.replace('_', '-')}" for f in ("intra_node_gbps", "inter_node_gbps") if getattr(ns, f) is not None]
        if given:
            _fail(f"--link-gbps sets both --intra-node-gbps and --inter-node-gbps, but {' and '.join(given)} was "
                  "given too; drop --link-gbps (deprecated)")
        logger.warning("--link-gbps is deprecated: it sets both --intra-node-gbps and --inter-node-gbps to %s",
                       ns.link_gbps)
    local = os.environ.get("LOCAL_WORLD_SIZE") if _world_from_env() is not None else None
    if local is not None and ns.gpus_per_node is not None and int(local) != ns.gpus_per_node:
        _fail(f"--gpus-per-node {ns.gpus_per_node}, but torchrun started {local} rank(s) per node "
              f"(LOCAL_WORLD_SIZE); drop --gpus-per-node or launch torchrun --nproc-per-node={ns.gpus_per_node}")
    if ns.nodes is not None or ns.gpus_per_node is not None:
        per_node = ns.gpus_per_node or (int(local) if local else 8)
        if ns.nodes is None:
            if world % per_node:
                _fail(f"--gpus-per-node {per_node} must divide the {world} rank(s) of the run; give --nodes too")
            nodes = world // per_node
        else:
            nodes = ns.nodes
        cluster = nodes * per_node
        if ns.dry_run and ns.nproc is not None and ns.nproc != cluster:
            _fail(f"--nodes {nodes} x --gpus-per-node {per_node} = {cluster} ranks, but --nproc is {ns.nproc}; drop "
                  "--nproc (a dry run plans for the cluster) or make them agree")
        if not ns.dry_run and cluster != world:
            launched = f"--nproc {ns.nproc}" if ns.nproc is not None else (
                f"WORLD_SIZE={world} (torchrun)" if _world_from_env() is not None else "a single process")
            _fail(f"--nodes {nodes} x --gpus-per-node {per_node} = {cluster} ranks, but the run has {world} "
                  f"({launched}); launch {cluster} ranks, or use --dry-run to plan for a cluster that is not here")
        ns.nodes, ns.gpus_per_node = nodes, per_node
        return cluster
    if local is not None:
        ns.gpus_per_node = int(local)
        ns.nodes = max(1, world // ns.gpus_per_node)
    elif ns.dry_run and _device_type(ns) == "cuda":
        ns.gpus_per_node = min(8, world)
        ns.nodes = math.ceil(world / ns.gpus_per_node)
    else:  # local ranks: one host
        ns.gpus_per_node, ns.nodes = world, 1
    return world


def _resolve_data_parallel(ns: argparse.Namespace, world: int) -> None:
    """HSDP's --dp-replicate x --dp-shard, and --dp filled in where --tp / --pp leave it implied."""
    for flag in ("dp_replicate", "dp_shard"):
        value = getattr(ns, flag)
        if value is not None and value < 1:
            _fail(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    hybrid = ns.dp_replicate is not None or ns.dp_shard is not None
    if hybrid and ns.dp_mode not in (None, "hsdp"):
        _fail(f"--dp-replicate / --dp-shard describe HSDP, but --dp-mode is {ns.dp_mode}; use --dp-mode hsdp (or "
              "drop it)")
    rest = (ns.tp or 1) * (ns.pp or 1) * (getattr(ns, "cp", None) or 1)
    implied = world // rest if world % rest == 0 else None
    if hybrid:
        dp = ns.dp if ns.dp is not None else (implied if implied is not None or not (ns.dp_replicate and ns.dp_shard)
                                              else ns.dp_replicate * ns.dp_shard)
        if dp is None:
            _fail(f"--dp-replicate / --dp-shard: the run's {world} ranks do not split over --tp {ns.tp or 1} x --pp "
                  f"{ns.pp or 1}; give --dp-replicate and --dp-shard")
        replicate = ns.dp_replicate or (dp // ns.dp_shard if dp % ns.dp_shard == 0 else None)
        shard = ns.dp_shard or (dp // ns.dp_replicate if dp % ns.dp_replicate == 0 else None)
        if replicate is None or shard is None or replicate * shard != dp:
            _fail(f"--dp-replicate {ns.dp_replicate} x --dp-shard {ns.dp_shard} must multiply to the data-parallel "
                  f"ranks ({dp})")
        if replicate < 2:
            _fail(f"--dp-replicate {replicate}: HSDP needs at least 2 replicas; with one, use --dp-mode fsdp "
                  f"--dp {dp}")
        ns.dp, ns.dp_replicate, ns.dp_shard, ns.dp_mode = dp, replicate, shard, "hsdp"
    elif ns.dp_mode == "hsdp" and ns.layout == "manual":
        _fail("--dp-mode hsdp needs --dp-replicate (replicas) and --dp-shard (ranks each replica is sharded over)")
    elif ns.dp is None and implied is not None:
        ns.dp = implied  # --tp 8 alone on 512 ranks: dp = 64


def validate(ns: argparse.Namespace, world: int) -> int:
    """Every check that needs no process group; raises :class:`TrainError` naming the flag and what would work.
    Returns the world size the run plans for (the cluster's, for a dry run of ``--nodes x --gpus-per-node``).

    A manual layout (``--dp/--tp/--pp``) is checked here; under ``--layout auto`` the layout is chosen later
    (:func:`schedlang.train.layout.choose`) and checked by :func:`validate_layout` then."""
    _resolve_init_from(ns)
    if ns.json and not ns.dry_run:
        _fail("--json writes the plan of --dry-run; add --dry-run (a launched run writes --metrics)")
    if getattr(ns, "trace_memory", False) and not ns.dry_run:
        _fail("--trace-memory runs the peak rank of the plan of --dry-run; add --dry-run (a launched run reports "
              "its measured peak memory in its metrics)")
    # the smoke-test sizes stand in where none were given; a plan for a large model warns about them
    ns.toy_defaults = [flag for flag, value in (("--global-batch", ns.global_batch), ("--seq", ns.seq))
                       if value is None]
    ns.global_batch = TOY_GLOBAL_BATCH if ns.global_batch is None else ns.global_batch
    ns.seq = TOY_SEQ if ns.seq is None else ns.seq
    world = resolve_cluster(ns, world)
    if ns.pp_schedule not in PP_SCHEDULES:
        _fail(f"--pp-schedule: unknown schedule {ns.pp_schedule!r}: valid schedules are {', '.join(PP_SCHEDULES)}")
    if ns.optimizer is not None and ns.optimizer not in OPTIMIZERS:
        _fail(f"--optimizer: unknown optimizer {ns.optimizer!r}: valid optimizers are {', '.join(OPTIMIZERS)}")
    for flag in ("dp", "tp", "pp"):
        value = getattr(ns, flag)
        if value is not None and value < 1:
            _fail(f"--{flag} must be at least 1, got {value}")
    for flag in ("steps", "global_batch", "seq", "eval_batches"):
        value = getattr(ns, flag)
        if value < 1:
            _fail(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if ns.nproc is not None and ns.nproc < 1:
        _fail(f"--nproc must be at least 1, got {ns.nproc}")
    if ns.lr <= 0 or not math.isfinite(ns.lr):
        _fail(f"--lr must be a positive number, got {ns.lr}")
    for flag in ("warmup", "save_every", "eval_every"):
        if getattr(ns, flag) < 0:
            _fail(f"--{flag.replace('_', '-')} must be at least 0, got {getattr(ns, flag)}")
    if ns.log_every < 1:
        _fail(f"--log-every must be at least 1, got {ns.log_every}")
    if not ns.grad_clip >= 0 or not math.isfinite(ns.grad_clip):  # `not >=` also refuses nan
        _fail(f"--grad-clip must be a number >= 0 (0: no clipping), got {ns.grad_clip}")
    if not ns.weight_decay >= 0 or not math.isfinite(ns.weight_decay):
        _fail(f"--weight-decay must be a number >= 0, got {ns.weight_decay}")
    if not ns.timeout > 0 or not math.isfinite(ns.timeout):
        _fail(f"--timeout must be a positive number of seconds, got {ns.timeout}")
    _positive(ns, "gpu_memory_gib")
    if ns.stop_after is not None and not 1 <= ns.stop_after <= ns.steps:
        _fail(f"--stop-after must be a step of the run, 1..{ns.steps} (--steps), got {ns.stop_after}")
    if ns.layout == "auto" and layout_given(ns):
        given = " ".join(f"--{k.replace('_', '-')} {getattr(ns, k)}" for k in ("dp", "tp", "pp", "cp",
                                                                                "dp_replicate", "dp_shard")
                         if getattr(ns, k) is not None)
        _fail(f"--layout auto chooses --dp, --tp and --pp itself, but {given} was given; drop {given} or "
              "--layout auto")
    ns.layout = "auto" if ns.layout == "auto" or (not layout_given(ns) and world > 1) else "manual"
    if ns.layout == "manual":
        _resolve_data_parallel(ns, world)
    if ns.json and os.environ.get("RANK", "0") == "0":
        _check_writable_file("--json", ns.json)
    if ns.probe and ns.layout != "auto":
        _fail("--probe times the best layouts --layout auto finds: it needs --layout auto (or no --dp/--tp/--pp "
              "on several ranks)")
    if ns.resume and not ns.checkpoint_dir:
        _fail("--resume needs --checkpoint-dir (the directory the checkpoints were saved to)")
    if ns.save_every and not ns.checkpoint_dir:
        _fail("--save-every needs --checkpoint-dir")
    if ns.async_save and not ns.checkpoint_dir:
        _fail("--async-save writes the checkpoints in the background: it needs --checkpoint-dir")
    if ns.stop_after is not None and ns.stop_after < ns.steps and not ns.checkpoint_dir:
        # the run would end with nothing saved, and could not be continued
        _fail(f"--stop-after {ns.stop_after} stops the run to continue it later with --resume, which needs "
              "--checkpoint-dir (the checkpoint of the last step is saved there)")
    if ns.eval_every and not ns.eval_data:
        _fail(f"--eval-every {ns.eval_every} evaluates on held-out data: it needs --eval-data")
    if ns.device == "cuda" and not torch.cuda.is_available() and not ns.dry_run:
        _fail("--device cuda but no CUDA device is available; use --device cpu")
    resolve_speed_defaults(ns)
    if os.environ.get("RANK", "0") == "0":  # rank 0 writes these, on its own host's file system
        if ns.metrics:
            _check_writable_file("--metrics", ns.metrics)
        if ns.export_hf:
            _check_writable_directory("--export-hf", ns.export_hf)
        if ns.plot:
            _check_writable_file("--plot", ns.plot)
            _check_plotting()
        if ns.tensorboard:
            _check_tensorboard()
            _check_writable_directory("--tensorboard", ns.tensorboard)
    if ns.checkpoint_dir:  # every rank writes its shards there
        _check_writable_directory("--checkpoint-dir", ns.checkpoint_dir)
    if ns.layout == "manual":
        for flag in ("dp", "tp", "pp", "cp"):
            if getattr(ns, flag, None) is None:
                setattr(ns, flag, 1)
        validate_layout(ns, world)
    return world


def resolve_speed_defaults(ns: argparse.Namespace) -> None:
    """The defaults that depend on the device: on a GPU the fastest path the benchmarks measured (bf16, per-layer
    compile, fused AdamW; optimize_model once the layout is known), on the CPU what runs well there (fp32, eager,
    torch's AdamW)."""
    cuda = _device_type(ns) == "cuda"
    if ns.dtype is None:
        ns.dtype = "bf16" if cuda else "fp32"
    if ns.compile is None:
        ns.compile = cuda
    if ns.optimizer is None:
        ns.optimizer = "fused-adamw" if cuda else "adamw"
    if ns.optimizer == "fused-adamw" and not cuda:
        logger.warning("--optimizer fused-adamw on the CPU runs its Triton kernel under the interpreter (slow); "
                       "--optimizer adamw is torch's")


def validate_layout(ns: argparse.Namespace, world: int) -> None:
    """The checks of a layout (given, or chosen by --layout auto) against the run and the other flags."""
    if getattr(ns, "cp", None) is None:  # --layout auto keeps the sequence whole
        ns.cp = 1
    if ns.cp < 1:
        _fail(f"--cp must be at least 1, got {ns.cp}")
    layout = ns.dp * ns.tp * ns.pp * ns.cp
    if layout != world:
        how = f"--nproc {ns.nproc}" if ns.nproc is not None else (
            f"WORLD_SIZE={world} (torchrun)" if _world_from_env() is not None else "a single process")
        cp = f" x --cp {ns.cp}" if ns.cp > 1 else ""
        _fail(f"--dp {ns.dp} x --tp {ns.tp} x --pp {ns.pp}{cp} = {layout} ranks, but the run has {world} ({how}); "
              f"launch {layout} ranks (--nproc {layout} or torchrun --nproc_per_node={layout}) or change the layout")
    if ns.cp > 1:
        _validate_context_parallel(ns)
    _validate_expert_parallel(ns)
    if ns.dp_mode is None:
        ns.dp_mode = "fsdp"
    if ns.reduce_dtype is None:
        ns.reduce_dtype = "fp32"
    if ns.optimize and ns.pp > 1:
        _fail(f"--optimize rewrites the whole model's norms, head and loss, which pipeline stages split: it works on "
              f"pp=1 layouts, got --pp {ns.pp}; drop --optimize or --pp")
    if ns.optimize is None:  # the default: on a GPU, where the layout lets it
        ns.optimize = _device_type(ns) == "cuda" and ns.pp == 1
    if ns.reduce_dtype == "bf16" and (ns.dtype != "bf16" or ns.dp < 2):
        _fail(f"--reduce-dtype bf16 sums bf16 gradients over the dp ranks: it needs --dtype bf16 and --dp >= 2, got "
              f"--dtype {ns.dtype} --dp {ns.dp}")
    if ns.no_reshard and (ns.dp_mode not in ("fsdp", "hsdp") or ns.dp < 2):
        _fail(f"--no-reshard keeps FSDP2's gathered weights: it needs --dp-mode fsdp and --dp >= 2, got --dp-mode "
              f"{ns.dp_mode} --dp {ns.dp} (--dp-mode hsdp keeps them too)")
    if ns.dp_mode == "hsdp" and (not getattr(ns, "dp_replicate", None) or ns.dp_replicate < 2
                                 or ns.dp_replicate * (ns.dp_shard or 0) != ns.dp):
        _fail(f"--dp-mode hsdp needs --dp-replicate (>= 2) x --dp-shard = --dp {ns.dp}, got --dp-replicate "
              f"{getattr(ns, 'dp_replicate', None)} --dp-shard {getattr(ns, 'dp_shard', None)}")
    if ns.dp_mode != "hsdp":
        ns.dp_replicate = ns.dp_shard = None
    if ns.activation_checkpoint == "selective" and ns.pp > 1 and not ns.dry_run:
        _fail(f"--activation-checkpoint selective runs on pp=1 layouts (the trainer checkpoints the whole model's "
              f"layers), got --pp {ns.pp}; use --activation-checkpoint full with pipelines")
    if ns.sp and ns.tp < 2:
        _fail("--sp (sequence parallelism) splits the sequence over the tp ranks: it needs --tp >= 2")
    given_stages = getattr(ns, "_stages_given", ns.stages_per_rank)
    ns._stages_given = given_stages
    ns.stages_per_rank = given_stages
    if ns.stages_per_rank is None:  # not `or`: an explicit 0 is refused below, not replaced by the default
        ns.stages_per_rank = 2 if ns.pp > 1 and ns.pp_schedule in ("Interleaved1F1B", "ZeroBubble") else 1
    if ns.stages_per_rank < 1:
        _fail(f"--stages-per-rank must be at least 1, got {ns.stages_per_rank}")
    if ns.pp == 1 and ns.stages_per_rank > 1:
        _fail("--stages-per-rank > 1 needs pipeline parallelism (--pp >= 2)")
    if ns.pp > 1 and ns.pp_schedule in ("1F1B", "GPipe") and ns.stages_per_rank != 1:
        _fail(f"--pp-schedule {ns.pp_schedule} holds one stage per rank; use Interleaved1F1B or ZeroBubble for "
              f"--stages-per-rank {ns.stages_per_rank}")
    given_mb = getattr(ns, "_microbatches_given", ns.microbatches)
    ns._microbatches_given = given_mb
    ns.microbatches = given_mb
    if ns.microbatches is None:
        ns.microbatches = ns.pp * ns.stages_per_rank if ns.pp > 1 else 1
    if ns.microbatches < 1:
        _fail(f"--microbatches must be at least 1, got {ns.microbatches}")
    if ns.global_batch % (ns.dp * ns.microbatches):
        _fail(f"--global-batch {ns.global_batch} must be divisible by --dp x --microbatches = {ns.dp} x "
              f"{ns.microbatches} = {ns.dp * ns.microbatches} (each dp rank splits its rows into microbatches)")
    if ns.pp > 1 and ns.pp_schedule in ("Interleaved1F1B", "ZeroBubble") and ns.microbatches % ns.pp:
        _fail(f"--pp-schedule {ns.pp_schedule} needs --microbatches divisible by --pp {ns.pp}, got {ns.microbatches}")


def _validate_context_parallel(ns: argparse.Namespace) -> None:
    """--cp against the other flags: a sequence that cuts into 2 x cp chunks, the plain loss."""
    if ns.seq % (2 * ns.cp):
        lower = ns.seq - ns.seq % (2 * ns.cp)
        _fail(f"--seq {ns.seq} does not split over --cp {ns.cp}: each sequence is cut into 2 x cp = {2 * ns.cp} "
              f"equal chunks (rank r holds chunks r and {2 * ns.cp - 1} - r), so --seq must be a multiple of "
              f"{2 * ns.cp}, e.g. {lower or 2 * ns.cp} or {lower + 2 * ns.cp}")
    if ns.optimize:  # given (its default is decided after this check)
        _fail("--optimize fuses the head with a loss inside the model, which would see only this rank's tokens under "
              "--cp; drop --optimize or --cp")
    ns.optimize = False


def _validate_expert_parallel(ns: argparse.Namespace) -> None:
    """``--ep`` against the other layout flags (see train/experts.py)."""
    if getattr(ns, "ep", None) is None:
        ns.ep = 1
    ep = ns.ep
    if ep < 1:
        _fail(f"--ep must be at least 1, got {ep}")
    if ep == 1:
        return
    data = ns.dp * ns.cp
    if data % ep:
        valid = ", ".join(str(d) for d in range(1, data + 1) if data % d == 0)
        _fail(f"--ep {ep}: expert parallelism is carved from the data-parallel ranks, --dp {ns.dp}"
              + (f" x --cp {ns.cp}" if ns.cp > 1 else "") + f" = {data}, which {ep} does not divide; valid --ep: "
              f"{valid}")
    if ns.tp > 1 and not ns.sp:
        _fail(f"--ep {ep} with --tp {ns.tp} needs --sp: the experts stay whole on every tp rank and each tp rank "
              "routes its own sequence slice through them (without --sp the tp ranks hold the same tokens and "
              "tensor parallelism would split the experts too); add --sp, or drop --tp or --ep")
    if ns.optimize:  # given (its default is decided after this check)
        _fail(f"--optimize with --ep {ep}: optimize_model's rewrites are not checked against spread experts yet; "
              "drop --optimize or --ep")
    ns.optimize = False


def _check_tensorboard() -> None:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        _fail(f"--tensorboard needs the tensorboard package, which is not installed ({e}); install it with "
              "pip install 'schedlang[tensorboard]' (or pip install tensorboard), or drop --tensorboard")


def _check_plotting() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        _fail(f"--plot draws with matplotlib, which is not installed ({e}); install it with pip install matplotlib "
              "(it comes with schedlang[docs]), or drop --plot")


# The outputs are written after training (the export) or from its first step on (the metrics): a path that
# cannot be written would fail the run only then, after minutes or hours. Writability is probed by creating a
# file, not with os.access, which says yes to root where the file system says no (/proc).
def _check_writable_file(flag: str, path: str) -> None:
    """``path`` can be opened for writing; nothing is left behind by the check."""
    target = Path(path)
    if target.is_dir():
        _fail(f"{flag}: {path!r} is a directory: give the path of a file to write")
    folder = target.parent
    if not folder.is_dir():
        _fail(f"{flag}: the directory {str(folder)!r} of {path!r} does not exist; create it first or give a path in "
              "an existing directory")
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as e:
        _fail(f"{flag}: {path!r} cannot be written ({e.strerror or e}); give a path in a writable directory")
    if not existed:  # the probe made it: leave the file system as it was
        target.unlink()


def _check_writable_directory(flag: str, path: str) -> None:
    """``path`` is a directory, or can be made one, in which files can be written; nothing is left behind."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        _fail(f"{flag}: {path!r} is an existing file: give a directory to write into (it is created if missing)")
    existing = nearest_existing(target)
    if not existing.is_dir():
        _fail(f"{flag}: {str(existing)!r} is a file, so the directory {path!r} cannot be created; give another path")
    reason = refuses_new_files(existing)
    if reason:
        _fail(f"{flag}: {path!r} cannot be written: {str(existing)!r} refuses new files ({reason}); give a "
              "directory in a writable place")


def _device_type(ns) -> str:
    return ns.device or ("cuda" if torch.cuda.is_available() else "cpu")

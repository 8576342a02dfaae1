"""The trainer: ``python -m schedlang.train`` and ``schedlang train``.

Trains a HF causal language model (LLaMA or GPT-2, built from a config with random weights) on a
``pp x dp x tp`` layout of ranks, entirely through schedules: ``shard_model`` for tensor (and
sequence) parallelism, ``fully_shard`` / ``replicate`` for data parallelism, ``cut_pipeline_stage``
for pipeline stages, ``schedlang.build`` to materialize it all. It runs

* under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` in the environment): one process per rank;
* with ``--nproc N``: it spawns N local ranks itself (gloo on the CPU, NCCL on GPUs);
* otherwise as a single process.

Whatever the layout, the run computes the same thing: the model starts from the same weights
(built on the meta device and initialized by ``build`` from ``--seed``, shard by shard, so that
every shard equals the slice of the unsharded initialization), the batch of step ``s`` is a pure
function of ``(seed, s)`` and the data (global batch ``B x (L + 1)`` tokens; inputs ``[:, :-1]``,
labels ``[:, 1:]``; data-parallel rank ``d`` takes rows ``[d B/D, (d + 1) B/D)``), and the loss is
the mean token cross entropy over the global batch. In fp32 every layout reports the losses of one
process, up to rounding. The learning rate, the batch and the random state of a step depend on
the step number only, so a run resumed from a checkpoint continues exactly, under any layout.

Fine-tuning (``--init-from DIR``): the model starts from the weights of a HF safetensors checkpoint
instead (``schedlang.build(..., pretrained=DIR)``: each rank reads only the slices it holds), and
its family and config come from ``DIR/config.json`` unless ``--model`` / ``--config`` say otherwise.

Data (``--data``): ``synthetic`` (learnable token sequences generated from the seed), a ``.npy``
file holding a 1-D array of token ids, or a raw ``.bin`` file of token ids, read as ``uint16``
when the vocabulary has fewer than 65536 entries and ``uint32`` otherwise (the nanoGPT format).
Each sequence of a batch starts at an offset drawn from ``(seed, step)``.

Example::

    python -m schedlang.train --model llama --config tiny --nproc 4 --dp 2 --tp 2 --device cpu \\
        --steps 20 --global-batch 8 --seq 64 --metrics metrics.jsonl
    torchrun --nproc_per_node=8 -m schedlang.train --config 1b --dp 2 --tp 2 --pp 2 --dtype bf16 \\
        --compile --global-batch 32 --seq 2048 --steps 1000 --checkpoint-dir ckpt --save-every 200
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from .errors import DistributedError, SchedlangError

__all__ = ["main", "TrainError", "build_parser", "model_config", "TokenBatches", "PEAK_FLOPS_PER_GPU"]

logger = logging.getLogger("schedlang.train")

#: dense bf16 peak of one H100 / H200 (SXM), the denominator of the reported MFU
PEAK_FLOPS_PER_GPU = 989e12
MODELS = ("llama", "gpt2")
PP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "ZeroBubble")
OPTIMIZERS = ("adamw", "fused-adamw", "sgd")


class TrainError(SchedlangError, ValueError):
    """A trainer flag, file or layout that cannot work; the message says what would."""


# ------------------------------------------------------------------------------------------------ flags
def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or "schedlang train",
        description="Train a HF causal LM (LLaMA or GPT-2) with tensor, sequence, data and pipeline parallelism "
                    "written as schedules. Run under torchrun, or spawn local ranks with --nproc N.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, help=f"model family: {', '.join(MODELS)} (default: llama, or the "
                   "family of --init-from)")
    m.add_argument("--config", default=None,
                   help="'tiny' (hidden 64, 4 layers, vocab 256), '1b' (LLaMA-1.1B; GPT-2 medium for gpt2) or the "
                        "path of a HF config.json (default: tiny, or the config.json of --init-from)")
    m.add_argument("--init-from", default=None, metavar="DIR",
                   help="fine-tune: start from the weights of a HF safetensors checkpoint (a directory written by "
                        "save_pretrained or --export-hf); each rank reads only its shards")
    m.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: mixed precision (fp32 master weights; bf16 compute via FSDP2's policy or autocast)")
    m.add_argument("--compile", action="store_true", help="torch.compile every transformer layer")
    m.add_argument("--activation-checkpoint", action="store_true", help="recompute each layer in backward")
    lay = p.add_argument_group("layout (world size = pp x dp x tp)")
    lay.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    lay.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    lay.add_argument("--pp", type=int, default=1, help="pipeline stages (ranks)")
    lay.add_argument("--sp", action="store_true", help="sequence parallelism on the tp ranks")
    lay.add_argument("--dp-mode", default="fsdp", choices=["fsdp", "ddp"], help="FSDP2 (fully_shard) or DDP "
                     "(replicate) on the dp ranks")
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
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=10, help="steps of the run (the learning-rate schedule spans them)")
    t.add_argument("--stop-after", type=int, default=None, help="stop after this step (resume later with --resume)")
    t.add_argument("--global-batch", type=int, default=8, help="sequences per step over all dp ranks")
    t.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    t.add_argument("--lr-schedule", default="cosine", choices=["cosine", "constant"],
                   help="after warmup: cosine decay to 10%% of --lr, or constant")
    t.add_argument("--warmup", type=int, default=0, help="linear warmup steps")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    t.add_argument("--optimizer", default="adamw", help="adamw (torch.optim.AdamW), fused-adamw (schedlang's fused "
                   "Triton AdamW), sgd (torch.optim.SGD, momentum 0.9)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--data", default="synthetic", help="'synthetic', or a .npy / raw .bin file of token ids "
                   "(.bin: uint16 if the vocabulary is < 65536, else uint32)")
    io = p.add_argument_group("checkpoints and output")
    io.add_argument("--checkpoint-dir", default=None, help="directory of distributed checkpoints (step-NNNNNNNN/)")
    io.add_argument("--save-every", type=int, default=0, help="save a checkpoint every K steps (0: only at the end)")
    io.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    io.add_argument("--export-hf", default=None, metavar="DIR", help="write the trained model as a HF model here")
    io.add_argument("--metrics", default=None, metavar="FILE", help="append one JSON line per step to FILE")
    io.add_argument("--log-every", type=int, default=1, help="print progress every K steps")
    return p


def _fail(msg: str) -> None:
    raise TrainError(msg)


def _world_from_env() -> Optional[int]:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def _resolve_init_from(ns: argparse.Namespace) -> None:
    """``--model`` and ``--config`` from ``--init-from``'s config.json where they are not given."""
    if ns.init_from is not None:
        directory = Path(ns.init_from)
        if not directory.is_dir():
            _fail(f"--init-from {ns.init_from!r}: no such directory (expected a HF checkpoint directory holding "
                  f"config.json and model.safetensors, as save_pretrained or --export-hf write it)")
        if ns.config is None:
            if not (directory / "config.json").is_file():
                _fail(f"--init-from {ns.init_from}: it has no config.json; give the model's config with --config")
            ns.config = str(directory)
        if ns.model is None:
            try:
                kind = json.loads((directory / "config.json").read_text()).get("model_type")
            except (OSError, ValueError):
                kind = None
            ns.model = kind if kind in MODELS else None
    ns.model = ns.model or "llama"
    ns.config = ns.config or "tiny"


def validate(ns: argparse.Namespace, world: int) -> None:
    """Every check that needs no process group; raises :class:`TrainError` naming the flag and what would work."""
    _resolve_init_from(ns)
    if ns.model not in MODELS:
        _fail(f"unknown --model {ns.model!r}: valid models are {', '.join(MODELS)}")
    if ns.pp_schedule not in PP_SCHEDULES:
        _fail(f"unknown --pp-schedule {ns.pp_schedule!r}: valid schedules are {', '.join(PP_SCHEDULES)}")
    if ns.optimizer not in OPTIMIZERS:
        _fail(f"unknown --optimizer {ns.optimizer!r}: valid optimizers are {', '.join(OPTIMIZERS)}")
    for flag in ("dp", "tp", "pp", "steps", "global_batch", "seq"):
        value = getattr(ns, flag)
        if value < 1:
            _fail(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if ns.nproc is not None and ns.nproc < 1:
        _fail(f"--nproc must be at least 1, got {ns.nproc}")
    if ns.lr <= 0 or not math.isfinite(ns.lr):
        _fail(f"--lr must be a positive number, got {ns.lr}")
    if ns.warmup < 0 or ns.save_every < 0 or ns.grad_clip < 0 or ns.log_every < 1:
        _fail("--warmup, --save-every and --grad-clip must be >= 0 and --log-every >= 1")
    if ns.stop_after is not None and not 1 <= ns.stop_after <= ns.steps:
        _fail(f"--stop-after must be a step of the run, 1..{ns.steps} (--steps), got {ns.stop_after}")
    layout = ns.dp * ns.tp * ns.pp
    if layout != world:
        how = f"--nproc {ns.nproc}" if ns.nproc is not None else (
            f"WORLD_SIZE={world} (torchrun)" if _world_from_env() is not None else "a single process")
        _fail(f"--dp {ns.dp} x --tp {ns.tp} x --pp {ns.pp} = {layout} ranks, but the run has {world} ({how}); "
              f"launch {layout} ranks (--nproc {layout} or torchrun --nproc_per_node={layout}) or change the layout")
    if ns.sp and ns.tp < 2:
        _fail("--sp (sequence parallelism) splits the sequence over the tp ranks: it needs --tp >= 2")
    ns.stages_per_rank = ns.stages_per_rank or (2 if ns.pp > 1 and ns.pp_schedule in ("Interleaved1F1B", "ZeroBubble")
                                                else 1)
    if ns.stages_per_rank < 1:
        _fail(f"--stages-per-rank must be at least 1, got {ns.stages_per_rank}")
    if ns.pp == 1 and ns.stages_per_rank > 1:
        _fail("--stages-per-rank > 1 needs pipeline parallelism (--pp >= 2)")
    if ns.pp > 1 and ns.pp_schedule in ("1F1B", "GPipe") and ns.stages_per_rank != 1:
        _fail(f"--pp-schedule {ns.pp_schedule} holds one stage per rank; use Interleaved1F1B or ZeroBubble for "
              f"--stages-per-rank {ns.stages_per_rank}")
    if ns.microbatches is None:
        ns.microbatches = ns.pp * ns.stages_per_rank if ns.pp > 1 else 1
    if ns.microbatches < 1:
        _fail(f"--microbatches must be at least 1, got {ns.microbatches}")
    if ns.global_batch % (ns.dp * ns.microbatches):
        _fail(f"--global-batch {ns.global_batch} must be divisible by --dp x --microbatches = {ns.dp} x "
              f"{ns.microbatches} = {ns.dp * ns.microbatches} (each dp rank splits its rows into microbatches)")
    if ns.pp > 1 and ns.pp_schedule in ("Interleaved1F1B", "ZeroBubble") and ns.microbatches % ns.pp:
        _fail(f"--pp-schedule {ns.pp_schedule} needs --microbatches divisible by --pp {ns.pp}, got {ns.microbatches}")
    if ns.resume and not ns.checkpoint_dir:
        _fail("--resume needs --checkpoint-dir (the directory the checkpoints were saved to)")
    if ns.save_every and not ns.checkpoint_dir:
        _fail("--save-every needs --checkpoint-dir")
    if ns.device == "cuda" and not torch.cuda.is_available():
        _fail("--device cuda but no CUDA device is available; use --device cpu")
    if ns.optimizer == "fused-adamw" and _device_type(ns) == "cpu":
        logger.warning("--optimizer fused-adamw on the CPU runs its Triton kernel under the interpreter (slow); "
                       "--optimizer adamw is torch's")


def _device_type(ns) -> str:
    return ns.device or ("cuda" if torch.cuda.is_available() else "cpu")


# ------------------------------------------------------------------------------------------------ models
_TINY = {
    "llama": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=128),
    "gpt2": dict(n_embd=64, n_layer=4, n_head=4, n_inner=128, vocab_size=256, n_positions=128, bos_token_id=255,
                 eos_token_id=255),
}
#: pretraining runs without dropout (GPT-2's configs default to 0.1); layouts then compute the same thing
_NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "llama": {}}
_1B = {
    # LLaMA-1.1B (TinyLlama's depth and width, with full multi-head attention)
    "llama": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=16, num_key_value_heads=16,
                  intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5),
    # GPT-2 has no 1B size whose heads split over 2, 4 and 8 ranks: GPT-2 medium (355M), vocabulary padded
    # from 50257 to 50304 so that it divides by the tensor-parallel sizes
    "gpt2": dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50304, n_positions=1024),
}


def _config_class(model: str):
    if model == "llama":
        from transformers import LlamaConfig

        return LlamaConfig
    from transformers import GPT2Config

    return GPT2Config


def model_config(model: str, config: str):
    """The HF config of ``--model`` / ``--config`` (``tiny``, ``1b`` or a config.json path or its directory)."""
    if model not in MODELS:
        _fail(f"unknown --model {model!r}: valid models are {', '.join(MODELS)}")
    klass = _config_class(model)
    if config in ("tiny", "1b"):
        cfg = klass(**(_TINY if config == "tiny" else _1B)[model], **_NO_DROPOUT[model])
        if config == "1b" and model == "gpt2":
            logger.info("--model gpt2 --config 1b is GPT-2 medium (355M parameters)")
    else:
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            _fail(f"--config {config!r} is neither 'tiny', '1b' nor an existing HF config.json (or its directory)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            _fail(f"--config {config}: cannot read a JSON config ({e})")
        kind = raw.get("model_type")
        if kind is not None and kind != klass.model_type:
            _fail(f"--config {config} describes a {kind!r} model but --model is {model!r} (model_type "
                  f"{klass.model_type!r})")
        cfg = klass.from_dict(raw)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    return cfg


@dataclass
class Dims:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    positions: int


def model_dims(model: str, cfg) -> Dims:
    if model == "llama":
        return Dims(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                    cfg.num_key_value_heads or cfg.num_attention_heads, cfg.intermediate_size, cfg.vocab_size,
                    cfg.max_position_embeddings)
    return Dims(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head, cfg.n_inner or 4 * cfg.n_embd, cfg.vocab_size,
                cfg.n_positions)


def validate_model(ns, dims: Dims) -> None:
    if ns.seq > dims.positions:
        _fail(f"--seq {ns.seq} exceeds the model's {dims.positions} positions; use --seq <= {dims.positions}")
    tp = ns.tp
    for what, n in (("attention heads", dims.heads), ("key/value heads", dims.kv_heads),
                    ("MLP intermediate size", dims.intermediate), ("vocabulary size", dims.vocab)):
        if n % tp:
            _fail(f"--tp {tp} must divide the model's {what} ({n}); valid --tp values divide {n}")
    if ns.sp and ns.seq % tp:
        _fail(f"--sp splits the sequence over --tp {tp} ranks: --seq {ns.seq} must be divisible by {tp}")
    stages = ns.pp * ns.stages_per_rank
    if stages > 1 and dims.layers < stages:
        _fail(f"--pp {ns.pp} x --stages-per-rank {ns.stages_per_rank} = {stages} pipeline stages but the model has "
              f"only {dims.layers} layers")


def _model_class(model: str):
    if model == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel


def _tied_names(model) -> Dict[str, str]:
    """``{name: first name}`` for every name of a parameter the model holds under several names (tied weights)."""
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n: group[0] for group in names.values() if len(group) > 1 for n in group}


def _layers_path(model: str) -> str:
    return "model.layers" if model == "llama" else "transformer.h"


def _flops_params(model) -> int:
    """Parameters that cost 6 flops per token in a train step: all but the input (and position) embeddings; a
    tied embedding counts once, as the output head."""
    total = sum(p.numel() for p in model.parameters())
    inp = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight is not inp:
        total -= inp.numel()
    for name, p in model.named_parameters():
        if name.endswith("wpe.weight"):
            total -= p.numel()
    return total


# ------------------------------------------------------------------------------------------------ data
def _mix(seed: int, step: int, salt: int = 0) -> int:
    """A 63-bit seed from (seed, step): splitmix64's finalizer, so nearby steps get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + salt * 0x94D049BB133111EB) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & (2**63 - 1)


class TokenBatches:
    """The global batch of each step, a pure function of ``(seed, step)`` and the data.

    ``batch(step)`` is a ``(global_batch, seq + 1)`` int64 CPU tensor. ``synthetic``: each row is an
    arithmetic sequence of token ids modulo the vocabulary (random start and stride, so a model can
    learn it and the loss falls). A file: each row is ``seq + 1`` consecutive tokens from an offset.
    """

    def __init__(self, spec: str, vocab: int, seed: int, global_batch: int, seq: int):
        self.spec, self.vocab, self.seed, self.rows, self.seq = spec, vocab, seed, global_batch, seq
        self.tokens = None
        if spec != "synthetic":
            self.tokens = self._open(spec, vocab)
            if len(self.tokens) < seq + 1:
                _fail(f"--data {spec} holds {len(self.tokens)} tokens, fewer than one sequence of --seq {seq} + 1")

    @staticmethod
    def _open(spec: str, vocab: int):
        import numpy as np

        path = Path(spec)
        if not path.is_file():
            _fail(f"--data {spec!r}: no such file (give 'synthetic', a .npy file or a raw .bin file of token ids)")
        if path.suffix == ".npy":
            try:
                arr = np.load(path, mmap_mode="r")
            except (OSError, ValueError) as e:
                _fail(f"--data {spec}: not a readable .npy file ({e})")
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                _fail(f"--data {spec}: expected a 1-D integer array of token ids, got shape {arr.shape} "
                      f"dtype {arr.dtype}")
            return arr
        if path.suffix == ".bin":
            dtype = np.uint16 if vocab < 65536 else np.uint32
            if path.stat().st_size % np.dtype(dtype).itemsize:
                _fail(f"--data {spec}: size {path.stat().st_size} bytes is not a whole number of {np.dtype(dtype).name} "
                      f"token ids (.bin files hold uint16 ids when the vocabulary is < 65536, else uint32)")
            return np.memmap(path, dtype=dtype, mode="r")
        _fail(f"--data {spec}: unknown file type {path.suffix!r}; use a .npy or a raw .bin file of token ids")

    def batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_mix(self.seed, step, 1))
        n = self.seq + 1
        if self.tokens is None:
            start = torch.randint(0, self.vocab, (self.rows, 1), generator=g)
            stride = torch.randint(1, 8, (self.rows, 1), generator=g)
            return (start + stride * torch.arange(n)) % self.vocab
        import numpy as np

        offsets = torch.randint(0, len(self.tokens) - n + 1, (self.rows,), generator=g).tolist()
        out = torch.from_numpy(np.stack([np.asarray(self.tokens[o:o + n], dtype=np.int64) for o in offsets]))
        top = int(out.max())
        if top >= self.vocab or int(out.min()) < 0:
            _fail(f"--data {self.spec}: token id {top} at step {step} is outside the model's vocabulary "
                  f"(0..{self.vocab - 1})")
        return out


# ------------------------------------------------------------------------------------------------ learning rate
def lr_at(ns, step: int) -> float:
    """Learning rate of step ``step`` (1-based): linear warmup, then cosine decay to 10% or constant."""
    if ns.warmup and step <= ns.warmup:
        return ns.lr * step / ns.warmup
    if ns.lr_schedule == "constant":
        return ns.lr
    span = max(1, ns.steps - ns.warmup - 1)  # the first step after warmup runs at the peak, the last at 10%
    progress = min(1.0, (step - ns.warmup - 1) / span)
    return ns.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


# ------------------------------------------------------------------------------------------------ checkpoints
_CKPT_PREFIX = "step-"
_TRAINER_STATE = "trainer.json"


def _checkpoint_path(root: str, step: int) -> Path:
    return Path(root) / f"{_CKPT_PREFIX}{step:08d}"


def latest_checkpoint(root: str) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (one whose trainer state was written last), or None."""
    base = Path(root)
    if not base.is_dir():
        return None
    done = [p for p in base.glob(f"{_CKPT_PREFIX}*") if (p / _TRAINER_STATE).is_file()]
    return max(done, key=lambda p: int(p.name[len(_CKPT_PREFIX):]), default=None)


# ------------------------------------------------------------------------------------------------ the run
class _Run:
    """One rank's view of the run: mesh, model, optimizer, data slice."""

    def __init__(self, ns, rank: int, world: int, device: torch.device):
        self.ns, self.rank, self.world, self.device = ns, rank, world, device
        self.mesh = None
        self.dp_rank = 0
        self.tp_group = None
        self.pipelined = ns.pp > 1

    # -- layout
    def make_mesh(self) -> None:
        if self.world == 1:
            return
        from .distributed.mesh import make_mesh

        ns = self.ns
        self.mesh = make_mesh(pp=ns.pp, dp=ns.dp, tp=ns.tp, device_type=self.device.type)
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.tp_group = self.mesh["tp"].get_group() if ns.tp > 1 else None
        self.pp_rank = self.mesh.get_local_rank("pp")

    def layout(self) -> str:
        ns = self.ns
        s = f"pp={ns.pp} dp={ns.dp} tp={ns.tp}"
        extras = []
        if ns.sp:
            extras.append("sp")
        if ns.dp > 1:
            extras.append(ns.dp_mode)
        if ns.pp > 1:
            extras.append(f"{ns.pp_schedule} x{ns.microbatches} mb")
        return s + (f" ({', '.join(extras)})" if extras else "")

    # -- model
    def build(self) -> None:
        import schedlang
        from .models import compile_layers, shard_model

        ns = self.ns
        self.cfg = model_config(ns.model, ns.config)
        self.dims = model_dims(ns.model, self.cfg)
        validate_model(ns, self.dims)
        with schedlang.init_empty_weights():
            model = _model_class(ns.model)(self.cfg)
        self.flops_params = _flops_params(model)
        tied = _tied_names(model)
        self.n_params = sum(p.numel() for p in model.parameters())
        sch = schedlang.create_schedule(model, mesh=self.mesh) if self.mesh is not None else \
            schedlang.create_schedule(model)
        del model
        layers = _layers_path(ns.model)
        if ns.tp > 1:
            shard_model(sch, sequence_parallel=ns.sp, gather_logits=False)
        if ns.activation_checkpoint:
            for i in range(self.dims.layers):
                sch[f"{layers}.{i}"].checkpoint()
        pipeline = None
        if self.pipelined:
            stages = ns.pp * ns.stages_per_rank
            for cut in _stage_cuts(self.dims.layers, stages):
                sch[f"{layers}.{cut}"].cut_pipeline_stage()
            pipeline = {"schedule": ns.pp_schedule, "n_microbatches": ns.microbatches, "loss_fn": self._pipeline_loss}
        bf16 = ns.dtype == "bf16"
        if ns.dp > 1:
            policy = "bf16" if bf16 else "fp32"
            if ns.dp_mode == "fsdp":
                for i in range(self.dims.layers):
                    sch[f"{layers}.{i}"].fully_shard(mp_policy=policy)
                sch.fully_shard(mp_policy=policy)
            else:
                sch.replicate(mp_policy=policy)
        # FSDP2 / DDP cast to bf16 themselves; otherwise autocast does (master weights stay fp32)
        self.autocast = bf16 and ns.dp == 1
        opt_cls, opt_kw = self._optimizer()
        torch.manual_seed(ns.seed)  # build initializes from the default generator: the same weights on every layout
        self.model, self.optimizer = schedlang.build(sch, optimizer=opt_cls, device=self.device, pipeline=pipeline,
                                                     pretrained=ns.init_from, **opt_kw)
        self.sch = sch
        self.grad_weight = self._tied_weights(tied) if self.pipelined and tied else {}
        if ns.compile:
            for module in self._modules():
                if any(isinstance(m, torch.nn.ModuleList) for m in module.modules()):  # a stage may hold no layer
                    compile_layers(module)
        logger.info("rank %d: built %s (%d parameters) as %s", self.rank, type(self.model).__name__, self.n_params,
                    self.layout())

    def _modules(self) -> List[torch.nn.Module]:
        stages = getattr(self.model, "stage_modules", None)  # a pipeline: the stages this rank holds
        return list(stages) if stages is not None else [self.model]

    def _tied_weights(self, tied: Dict[str, str]) -> Dict[int, float]:
        """A tied weight used by stages on several pp ranks has a copy on each (with the same summed gradient):
        per copy, the share that counts it once in the gradient norm."""
        import torch.distributed as dist

        mine: Dict[int, str] = {}
        for module in self._modules():
            for name, p in module.named_parameters(remove_duplicate=False):
                if name in tied:
                    mine[id(p)] = tied[name]
        everyone: List[Any] = [None] * self.world
        dist.all_gather_object(everyone, (self.pp_rank, sorted(set(mine.values()))))
        holders = {g: len({pp for pp, groups in everyone if g in groups}) for g in set(mine.values())}
        return {pid: 1.0 / holders[g] for pid, g in mine.items()}

    def _optimizer(self):
        ns = self.ns
        if ns.optimizer == "sgd":
            return torch.optim.SGD, {"lr": ns.lr, "momentum": 0.9, "weight_decay": ns.weight_decay}
        kw = {"lr": ns.lr, "betas": (0.9, 0.95), "weight_decay": ns.weight_decay}
        if ns.optimizer == "fused-adamw":
            return "adamw", kw
        return torch.optim.AdamW, kw

    # -- loss
    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token cross entropy of this rank's rows; vocabulary-parallel when the logits stay split."""
        if self.ns.tp > 1 and logits.shape[-1] != self.dims.vocab:
            from .distributed.cross_entropy import vocab_parallel_cross_entropy

            return vocab_parallel_cross_entropy(logits.flatten(0, -2), labels.flatten(), group=self.tp_group)
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())

    def _pipeline_loss(self, output, target):
        logits = output.logits if hasattr(output, "logits") else (output[0] if isinstance(output, (tuple, list))
                                                                 else output)
        return self._loss(logits, target)

    # -- one step
    def step(self, step: int, tokens: torch.Tensor) -> Dict[str, float]:
        ns = self.ns
        lr = lr_at(ns, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(_mix(ns.seed, step, 2))  # dropout and any other draws: a function of the step
        rows = ns.global_batch // ns.dp
        local = tokens[self.dp_rank * rows:(self.dp_rank + 1) * rows].to(self.device, non_blocking=True)
        inputs, labels = local[:, :-1], local[:, 1:]
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)
        if self.pipelined:
            losses: List[torch.Tensor] = []
            with autocast:
                self.model.step(inputs, target=labels, losses=losses)
            # the last stage holds one mean loss per microbatch (equal token counts): their mean is the rows' mean
            local_loss = torch.stack([l.detach().float() for l in losses]).mean() if losses else None
        else:
            local_loss = torch.zeros((), device=self.device)
            m = ns.microbatches
            for x, y in zip(inputs.chunk(m), labels.chunk(m)):
                with autocast:
                    logits = self.model(input_ids=x, use_cache=False).logits
                loss = self._loss(logits, y) / m
                loss.backward()
                local_loss += loss.detach().float()
        grad_norm = self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": self._global_loss(local_loss), "lr": lr, "grad_norm": grad_norm}

    def _holds_loss(self) -> bool:
        return not self.pipelined or self.pp_rank == self.ns.pp - 1

    def _global_loss(self, local_loss: Optional[torch.Tensor]) -> float:
        """Mean over the global batch: every rank that holds a loss adds loss / (ranks holding one); a sum over all."""
        if self.world == 1:
            return float(local_loss)
        import torch.distributed as dist

        holders = self.ns.dp * self.ns.tp  # tp ranks hold the same value: each counted 1 / tp
        value = local_loss / holders if (local_loss is not None and self._holds_loss()) else None
        buf = value.reshape(1).to(self.device) if value is not None else torch.zeros(1, device=self.device)
        dist.all_reduce(buf)
        return float(buf)

    def _params(self) -> List[torch.nn.Parameter]:
        seen, out = set(), []
        for m in self._modules():  # two stages of one rank may share a tied weight: once
            for p in m.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _clip(self) -> float:
        """Global gradient norm over every rank's shards (each distinct element counted once); clips to --grad-clip."""
        params = [p for p in self._params() if p.grad is not None]
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover
            DTensor = ()
        per_stage = self.world // self.ns.pp  # ranks of one pipeline stage each hold a piece or a copy
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        for p in params:
            g = p.grad
            pieces = self.grad_weight.get(id(p), 1.0)
            if DTensor and isinstance(g, DTensor):
                for dim, placement in enumerate(g.placements):
                    if placement.is_partial():  # pragma: no cover - gradients are reduced by now
                        raise TrainError(f"gradient of shape {tuple(g.shape)} is still a partial sum")
                    if not placement.is_replicate():  # Shard, and FSDP2's strided shards of TP shards
                        pieces *= g.device_mesh.size(dim)
                g = g.to_local()
            total += g.detach().float().pow(2).sum() * (pieces / per_stage)
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(total)
        norm = float(total.sqrt())
        clip = self.ns.grad_clip
        if clip and norm > clip and math.isfinite(norm):
            scale = clip / (norm + 1e-6)
            with torch.no_grad():
                for p in params:
                    p.grad.mul_(scale)
        return norm

    # -- checkpoints
    def save(self, step: int) -> Path:
        import schedlang

        ns = self.ns
        path = _checkpoint_path(ns.checkpoint_dir, step)
        extra = {"seed": ns.seed, "data": ns.data, "global_batch": ns.global_batch, "seq": ns.seq,
                 "steps": ns.steps, "model": ns.model, "config": ns.config, "layout": self.layout()}
        schedlang.save_checkpoint(str(path), self.model, self.optimizer, step=step, extra=extra)
        self._barrier()
        if self.rank == 0:  # written last: its presence marks the checkpoint complete
            (path / _TRAINER_STATE).write_text(json.dumps({"step": step, **extra}, indent=1) + "\n")
        self._barrier()
        logger.info("saved checkpoint %s", path)
        return path

    def load(self) -> int:
        import schedlang

        ns = self.ns
        path = latest_checkpoint(ns.checkpoint_dir)
        if path is None:
            _fail(f"--resume: no complete checkpoint in {ns.checkpoint_dir} (expected {_CKPT_PREFIX}NNNNNNNN/ "
                  f"directories holding {_TRAINER_STATE})")
        state = json.loads((path / _TRAINER_STATE).read_text())
        for key in ("seed", "data", "global_batch", "seq", "model"):
            if state.get(key) != getattr(ns, key):
                logger.warning("resuming a run saved with --%s %s under --%s %s: the continuation is not the same run",
                               key.replace("_", "-"), state.get(key), key.replace("_", "-"), getattr(ns, key))
        info = schedlang.load_checkpoint(str(path), self.model, self.optimizer)
        step = int(info.get("step", state["step"])) if isinstance(info, dict) else int(state["step"])
        logger.info("resumed from %s (step %d, saved as %s)", path, step, state.get("layout"))
        return step

    def export(self, directory: str) -> None:
        import schedlang

        schedlang.export_hf(self.model, directory)
        self._barrier()

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def _stage_cuts(layers: int, stages: int) -> List[int]:
    """Indices of the layers after which a stage ends: ``stages`` near-equal runs of layers."""
    bounds = [round(layers * (i + 1) / stages) for i in range(stages - 1)]
    return [b - 1 for b in bounds]


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # peak resident set, KiB on Linux
    return kib / 2**20


def _max_over_ranks(value: float, world: int, device: torch.device) -> float:
    if world == 1:
        return value
    import torch.distributed as dist

    buf = torch.tensor([value], device=device, dtype=torch.float64 if device.type == "cpu" else torch.float32)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return float(buf)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def train(ns: argparse.Namespace, rank: int = 0, world: int = 1) -> Optional[Dict[str, Any]]:
    """Run the training loop on this rank (process group already initialized when ``world > 1``).

    Returns the summary on rank 0 (``None`` elsewhere).
    """
    device_type = _device_type(ns)
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local_world > 1:  # ranks sharing the host's cores: no oversubscription
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    run = _Run(ns, rank, world, device)
    run.make_mesh()
    run.build()
    batches = TokenBatches(ns.data, run.dims.vocab, ns.seed, ns.global_batch, ns.seq)
    start = run.load() if ns.resume else 0
    last = ns.stop_after or ns.steps
    if start >= last:
        _fail(f"--resume: the checkpoint is at step {start}, nothing left to run up to step {last}")
    is_main = rank == 0
    metrics = open(ns.metrics, "a" if ns.resume else "w") if (ns.metrics and is_main) else None
    layout = run.layout()
    tokens_per_step = ns.global_batch * ns.seq
    flops_per_token = 6 * run.flops_params + 12 * run.dims.layers * run.dims.hidden * ns.seq
    peak = PEAK_FLOPS_PER_GPU * world
    if is_main:
        _progress(f"schedlang train: {ns.model} {ns.config} ({run.n_params / 1e6:.1f}M parameters), {layout}, "
                  f"{world} rank(s) on {device.type}, global batch {ns.global_batch} x {ns.seq} tokens, "
                  f"steps {start + 1}..{last} of {ns.steps}")
    history: List[Dict[str, Any]] = []
    t_run = time.perf_counter()
    try:
        for step in range(start + 1, last + 1):
            tokens = batches.batch(step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = run.step(step, tokens)  # the loss is read back, which waits for the step
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            mem = _max_over_ranks(_memory_gib(device), world, device)
            tps = tokens_per_step / dt
            rec = {"step": step, "loss": out["loss"], "tokens_per_s": tps, "mfu": tps * flops_per_token / peak,
                   "mem_gib": mem, "lr": out["lr"], "grad_norm": out["grad_norm"], "step_time_s": dt,
                   "layout": layout}
            history.append(rec)
            if metrics is not None:
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
            if is_main and (step % ns.log_every == 0 or step == last):
                _progress(f"step {step:>{len(str(ns.steps))}}/{ns.steps}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
                          f"{tps:,.0f} tok/s  mfu {100 * rec['mfu']:.2f}%  mem {mem:.2f} GiB  {1e3 * dt:.0f} ms")
            if not math.isfinite(out["loss"]):
                raise TrainError(f"the loss is {out['loss']} at step {step}; lower --lr or use --dtype fp32")
            if ns.checkpoint_dir and ((ns.save_every and step % ns.save_every == 0) or step == last):
                run.save(step)
    finally:
        if metrics is not None:
            metrics.close()
    if ns.export_hf:
        run.export(ns.export_hf)
    if not is_main:
        return None
    timed = history[1:] or history  # the first step pays for warm-up and compilation
    summary = {"steps": len(history), "first_step": start + 1, "last_step": last,
               "final_loss": history[-1]["loss"],
               "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed),
               "mfu": sum(r["mfu"] for r in timed) / len(timed),
               "mem_gib": max(r["mem_gib"] for r in history), "seconds": time.perf_counter() - t_run,
               "layout": layout}
    _progress(f"done: steps {start + 1}..{last}, final loss {summary['final_loss']:.4f}, "
              f"{summary['tokens_per_s']:,.0f} tok/s, mfu {100 * summary['mfu']:.2f}%, "
              f"peak mem {summary['mem_gib']:.2f} GiB, {summary['seconds']:.1f} s")
    return summary


def _rank_main(rank: int, world: int, options: Dict[str, Any]):
    """Entry point of a rank spawned by ``--nproc`` (process group set up by ``run_distributed``)."""
    logging.basicConfig(level=options.pop("_log_level", logging.WARNING), format="%(name)s: %(message)s")
    return train(argparse.Namespace(**options), rank, world)


def _torchrun_main(ns: argparse.Namespace, world: int) -> int:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    backend = "nccl" if _device_type(ns) == "cuda" else "gloo"
    if _device_type(ns) == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=ns.timeout))
    try:
        train(ns, rank, world)
        return 0
    except SchedlangError as e:
        print(f"schedlang train: rank {rank}: error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        print(f"schedlang train: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr)
        return 1
    finally:
        # a rank that fails leaves: torchrun stops the others once one exits non-zero
        try:
            dist.destroy_process_group()
        except Exception:  # pragma: no cover
            pass


_OWN_ERRORS = ("TrainError", "CheckpointError", "ScheduleValueError", "ScheduleTypeError", "ShardError")


def _failure_summary(error: DistributedError) -> str:
    """One line per failed rank (its exception), from the launcher's tracebacks."""
    text = str(error)
    lines = []
    for block in text.split("rank ")[1:]:
        head, _, body = block.partition(" failed:\n")
        if not body:
            continue
        body_lines = [l for l in body.rstrip().splitlines() if l.strip()]
        # the exception starts at the last unindented "SomeError: ..." line; its message may span lines
        starts = [i for i, l in enumerate(body_lines) if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", l)]
        last = [" ".join(l.strip() for l in body_lines[starts[-1]:])] if starts else body_lines[-1:]
        if last:
            message = last[-1].strip()
            kind, sep, rest = message.partition(": ")
            if sep and (kind.startswith("schedlang.") or kind in _OWN_ERRORS):  # our own errors read as their message
                message = rest
            lines.append(f"rank {head}: {message}")
    if not lines:
        return text.splitlines()[-1] if text else "distributed run failed"
    # the same error on every rank reads once
    messages = {l.split(": ", 1)[1] for l in lines}
    return lines[0].split(": ", 1)[1] if len(messages) == 1 else "; ".join(lines)


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    """The command line; returns the exit status (0 done, 2 bad flags or files, 1 a failed run)."""
    parser = build_parser(prog)
    ns = parser.parse_args(list(argv) if argv is not None else None)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    env_world = _world_from_env()
    if ns.nproc is not None and env_world is not None and env_world > 1:
        print("schedlang train: error: --nproc spawns its own ranks; do not combine it with torchrun", file=sys.stderr)
        return 2
    world = ns.nproc if ns.nproc is not None else (env_world or 1)
    try:
        validate(ns, world)
        cfg = model_config(ns.model, ns.config)
        validate_model(ns, model_dims(ns.model, cfg))
        TokenBatches(ns.data, model_dims(ns.model, cfg).vocab, ns.seed, ns.global_batch, ns.seq)
        if ns.init_from is not None:
            from .pretrained import read_index

            read_index(ns.init_from)  # readable safetensors, before any rank starts
        if ns.resume:
            saved = latest_checkpoint(ns.checkpoint_dir)
            if saved is None:
                _fail(f"--resume: no complete checkpoint in {ns.checkpoint_dir}")
            at = int(saved.name[len(_CKPT_PREFIX):])
            if at >= (ns.stop_after or ns.steps):
                _fail(f"--resume: the latest checkpoint ({saved}) is at step {at}; nothing is left to run up to step "
                      f"{ns.stop_after or ns.steps} (raise --steps)")
    except SchedlangError as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank finds it: say it once
            print(f"schedlang train: error: {e}", file=sys.stderr)
        return 2
    try:
        if env_world is not None and env_world > 1:
            return _torchrun_main(ns, env_world)
        if world == 1:
            train(ns)
            return 0
        from .distributed.launch import run_distributed

        options = dict(vars(ns), _log_level=logging.getLogger("schedlang").getEffectiveLevel())
        backend = "nccl" if _device_type(ns) == "cuda" else "gloo"
        if backend == "nccl" and torch.cuda.device_count() < world:
            _fail(f"--nproc {world} on cuda needs {world} GPUs, found {torch.cuda.device_count()}")
        run_distributed(_rank_main, world_size=world, args=(options,), backend=backend, timeout=365 * 86400.0,
                        collective_timeout=ns.timeout)
        return 0
    except SchedlangError as e:
        if isinstance(e, DistributedError):
            logger.debug("%s", e)
            print(f"schedlang train: error: {_failure_summary(e)}", file=sys.stderr)
            return 1
        print(f"schedlang train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(prog="python -m schedlang.train"))

"""Scale-out training step: schedlang's data- and tensor-parallel layouts against PyTorch's own, on N GPUs.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc_per_node=2 bench/bench_scale.py [--works w1,w2] [--variants v1,v2] [--results-dir DIR]

    torchrun --nproc_per_node=2 bench/bench_scale.py --tiny     # 2-layer models on CPU gloo ranks, seconds

One process per GPU (NCCL). Every variant of a work runs in the same process, one after the other,
like for like: the same weights (HF's init with seed 0), the same global batch of
``batch x world`` sequences of ``seq`` tokens (``--batch`` per GPU, default 4 x 2048; a
data-parallel rank takes its rows of it, a tensor-parallel group all of its data rank's rows),
labels shifted on the host (``ids`` rolled by one, the last position ignored: the logits are
never sliced), ``use_cache=False``, bf16 compute with fp32 master weights and fp32 gradient
reduction, fused AdamW (lr 1e-4), each decoder block compiled on its own. tokens/s counts the
tokens of the whole global batch; MFU uses 989 TFLOP/s per GPU (``bench/harness.py``). So a
tensor-parallel group of 2 trains on 8 sequences a step here, where ``shared/bench/tp_titan.py``
takes 4: compare layouts by tokens/s, not by step time.

Works:

* ``llama-1.1b-2gpu``: LLaMA-1.1B (22 layers, hidden 2048, 16 heads, 16 kv heads, intermediate
  5632, vocab 32000, 2048 positions), SDPA attention.
* ``llama-8b-layers``: LLaMA-3-8B's layer shapes (hidden 4096, 32 heads, 8 kv heads,
  intermediate 14336, vocab 128256) with ``--layers-8b`` decoder layers (default 8), so that the
  model fits on 2 GPUs; the JSON rows say how many.

Variants (role ``baseline``: PyTorch alone, as ``shared/bench/fsdp_titan.py`` / ``tp_titan.py``
set it up; role ``schedlang``: through schedlang's schedule API):

* ``fsdp2-titan``: ``fully_shard`` on every block (compiled first), then the root;
  ``MixedPrecisionPolicy(bf16 params, fp32 reduce)``; ``torch.optim.AdamW(fused=True)``.
* ``tp-titan``: ``parallelize_module`` (vocabulary-parallel embedding, colwise q/k/v/gate/up,
  rowwise o/down, colwise LM head with logits left sharded), loss under ``loss_parallel``, bf16
  autocast, per-block compile, fused AdamW over the DTensor and the plain parameters.
* ``tp-fsdp-titan``: the 2-D composition, ``tp-titan``'s plan on ``tp`` then FSDP2 on ``dp``
  (``--tp2d`` ranks per tensor-parallel group, the rest data parallel).
* ``schedlang-fsdp``: ``create_schedule`` on a ``dp`` mesh, ``sch["model.layers.i"].fully_shard()``
  per layer and ``sch.fully_shard()`` at the root, ``schedlang.build(sch, optimizer=AdamW,
  fused=True)``, ``schedlang.models.compile_layers``. Suffixes: ``-noreshard``
  (``reshard_after_forward=False`` on the layers: one all-gather less per layer and step),
  ``-fusedadamw`` (schedlang's multi-tensor Triton AdamW, ``optimizer="adamw"``).
* ``schedlang-tp``: ``schedlang.models.shard_model(sch)`` on a ``tp`` mesh (vocabulary-parallel
  embedding, LM head and cross entropy), bf16 autocast, ``compile_layers``.
* ``schedlang-tp-fsdp``: ``shard_model`` then ``fully_shard`` on a 2-D ``dp x tp`` mesh
  (``--tp2d``; dp=1 x tp=2 on 2 GPUs).

Correctness, in the same run (column ``check``, "ok" or "FAIL <why>"): each rank runs the plain
model eagerly on its share of the global batch once; the global mean loss of every variant's
first step must agree with it within bf16 tolerance (1e-2 relative); the global gradient norm
after the first backward and the loss after the warm-up steps (the batch repeats) must agree
with the work's first variant that ran (5% and 2%). A variant that fails records "FAIL <error>"
and the others still run. ``--tiny`` runs 2-layer models in fp32 on CPU ranks (gloo) without
compilation (``--compile`` to include it) to check the script itself.

Results: a table on rank 0, and ``bench/results/<date>-scale.json`` (``--name``, ``--results-dir``),
in the shape ``bench/harness.py`` describes; rows of the same day in that file are merged, so the
works (or groups of variants) can run as separate commands; files from separate machines merge
with ``python bench/harness.py --merge-into bench/results/<date>-scale.json a.json b.json``.
Each variant compiles its blocks afresh (about a minute on an H100/H200), so a work's default
list takes some 10 minutes; start each group with the same first variant (``fsdp2-titan``) so
that the cross-variant checks compare against the same anchor.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/harness.py, beside this file)

WORKS = ("llama-1.1b-2gpu", "llama-8b-layers")
BASELINES = ("fsdp2-titan", "tp-titan", "tp-fsdp-titan")
SCHEDLANG = ("schedlang-fsdp", "schedlang-fsdp-noreshard", "schedlang-fsdp-fusedadamw",
             "schedlang-fsdp-noreshard-fusedadamw", "schedlang-tp", "schedlang-tp-fsdp")
DEFAULT_VARIANTS = {
    "llama-1.1b-2gpu": ("fsdp2-titan", "tp-titan", "schedlang-fsdp", "schedlang-fsdp-noreshard",
                        "schedlang-fsdp-fusedadamw", "schedlang-fsdp-noreshard-fusedadamw", "schedlang-tp"),
    "llama-8b-layers": ("fsdp2-titan", "tp-titan", "tp-fsdp-titan", "schedlang-fsdp", "schedlang-fsdp-noreshard",
                        "schedlang-tp", "schedlang-tp-fsdp"),
}
LR = 1e-4
#: relative tolerances of the check: first loss vs the eager reference; gradient norm and the last
#: warm-up loss vs the work's first variant (bf16 compute; the fp32 --tiny run uses the second set)
TOL_BF16 = {"loss": 1e-2, "grad_norm": 5e-2, "trajectory": 2e-2}
TOL_FP32 = {"loss": 1e-4, "grad_norm": 1e-3, "trajectory": 1e-3}


class NotAvailable(RuntimeError):
    """A schedlang API this variant needs is not there (yet)."""


# --------------------------------------------------------------------------------------------- models
def llama_config(work: str, args):
    from transformers import LlamaConfig

    if args.tiny:
        shapes = {"llama-1.1b-2gpu": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                          intermediate_size=160, vocab_size=256),
                  "llama-8b-layers": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=224, vocab_size=512)}[work]
        cfg = LlamaConfig(num_hidden_layers=2, max_position_embeddings=64, **shapes)
    elif work == "llama-1.1b-2gpu":
        cfg = LlamaConfig(num_hidden_layers=22, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                          intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048)
    elif work == "llama-8b-layers":
        cfg = LlamaConfig(num_hidden_layers=args.layers_8b, hidden_size=4096, num_attention_heads=32,
                          num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                          max_position_embeddings=max(8192, args.seq))
    else:
        raise ValueError(f"unknown work {work!r}: valid are {', '.join(WORKS)}")
    cfg._attn_implementation = "sdpa"
    return cfg


def full_model(cfg, device):
    """The unsharded model with HF's initialization from seed 0, built on ``device`` (the same weights every
    time it is called with the same arguments)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model


# ------------------------------------------------------------------------------------------ one variant
@dataclass
class Setup:
    """A built variant: its model and optimizer, how a step computes the loss, and which rows it trains on."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, labels) -> scalar loss
    dp: int
    tp: int
    dp_rank: int
    notes: Dict[str, Any] = field(default_factory=dict)


class Context:
    """What every variant of one run shares: device, world, precision, meshes (made once, reused)."""

    def __init__(self, args, device, world):
        self.args, self.device, self.world = args, device, world
        self.cuda = device.type == "cuda"
        self.bf16 = self.cuda  # --tiny runs in fp32 on the CPU
        self._meshes: Dict[Any, Any] = {}

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()

    def mp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.bf16:
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def adamw_kwargs(self):
        # torch's fused AdamW on GPUs; on the CPU (--tiny) the foreach one, which takes DTensors on gloo
        return {"lr": LR, "fused": True} if self.cuda else {"lr": LR, "foreach": True}

    def titan_mesh(self, dp: int, tp: int):
        """A ("dp", "tp") DeviceMesh made with torch alone, for the baselines."""
        key = ("titan", dp, tp)
        if key not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            self._meshes[key] = init_device_mesh(self.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        return self._meshes[key]

    def schedlang_mesh(self, dp: int, tp: int):
        key = ("schedlang", dp, tp)
        if key not in self._meshes:
            try:
                from schedlang.distributed.mesh import make_mesh
            except ImportError as e:
                raise NotAvailable(f"schedlang.distributed.mesh.make_mesh ({e})") from e
            self._meshes[key] = make_mesh(pp=1, dp=dp, tp=tp, device_type=self.device.type)
        return self._meshes[key]

    def compile_block(self, block):
        return torch.compile(block) if self.args.compile else block


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


def _adamw_groups(model):
    """One group for DTensor parameters and one for plain ones (the fused kernel takes them apart)."""
    DTensor = _dtensor_cls()
    dparams = [p for p in model.parameters() if isinstance(p, DTensor)]
    pparams = [p for p in model.parameters() if not isinstance(p, DTensor)]
    return [{"params": g} for g in (dparams, pparams) if g]


def _plain_loss(logits, labels):
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


# -- baselines: PyTorch alone, the reference scripts' plans
def make_fsdp2_titan(ctx: Context, cfg) -> Setup:
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.titan_mesh(ctx.world, 1)["dp"]
    model = full_model(cfg, ctx.device)
    mp = ctx.mp_policy()
    for i, block in enumerate(model.model.layers):
        block = ctx.compile_block(block)
        model.model.layers[i] = block
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), **ctx.adamw_kwargs())

    def loss_fn(ids, labels):
        return _plain_loss(model(input_ids=ids, use_cache=False).logits, labels)

    return Setup(model, opt, loss_fn, dp=ctx.world, tp=1, dp_rank=mesh.get_local_rank())


def _titan_tp_plan(cfg):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{p}.{n}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{p}.mlp.down_proj"] = RowwiseParallel()
    return plan


def make_tp_titan(ctx: Context, cfg, dp: int = 1, fsdp: bool = False) -> Setup:
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    tp = ctx.world // dp
    mesh = ctx.titan_mesh(dp, tp)
    model = full_model(cfg, ctx.device)
    if tp > 1:
        parallelize_module(model, mesh["tp"], _titan_tp_plan(cfg))
    for i, block in enumerate(model.model.layers):
        model.model.layers[i] = ctx.compile_block(block)
    if fsdp:  # FSDP2 on the data dimension over the tensor-parallel DTensors; it casts to bf16 itself
        from torch.distributed.fsdp import fully_shard

        mp = ctx.mp_policy()
        for block in model.model.layers:
            fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    opt = torch.optim.AdamW(_adamw_groups(model), **ctx.adamw_kwargs())
    amp = contextlib.nullcontext if fsdp else ctx.autocast
    parallel_loss = loss_parallel if tp > 1 else contextlib.nullcontext

    class _Loss:
        """The loss under ``loss_parallel``; its backward must run under it too (see ``backward``)."""

        def __call__(self, ids, labels):
            with amp():
                if fsdp:  # through the root, whose FSDP2 hooks gather the embedding, final norm and head
                    logits = model(input_ids=ids, use_cache=False).logits
                else:  # as tp_titan.py: the body, then the head
                    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
                    logits = model.lm_head(hidden)
            with parallel_loss():
                return _plain_loss(logits, labels)

        @staticmethod
        def backward(loss):
            with parallel_loss():
                loss.backward()

    return Setup(model, opt, _Loss(), dp=dp, tp=tp, dp_rank=mesh.get_local_rank("dp"))


# -- schedlang: through the schedule API
def _schedlang():
    try:
        import schedlang
    except ImportError as e:
        raise NotAvailable(f"schedlang ({e})") from e
    return schedlang


def _need(obj, name: str, what: str):
    if not hasattr(obj, name):
        raise NotAvailable(what)
    return getattr(obj, name)


def _schedlang_optimizer(ctx: Context, fused_triton: bool):
    if fused_triton:
        return "adamw", {"lr": LR}
    return torch.optim.AdamW, ctx.adamw_kwargs()


def _compile_layers(ctx: Context, model):
    if ctx.args.compile:
        from schedlang import models

        _need(models, "compile_layers", "schedlang.models.compile_layers")(model)


def make_schedlang_fsdp(ctx: Context, cfg, reshard: Optional[bool], fused_triton: bool) -> Setup:
    schedlang = _schedlang()
    create_schedule = _need(schedlang, "create_schedule", "schedlang.create_schedule")
    build = _need(schedlang, "build", "schedlang.build")
    mesh = ctx.schedlang_mesh(ctx.world, 1)
    sch = create_schedule(full_model(cfg, ctx.device), mesh=mesh)
    _need(sch, "fully_shard", "Schedule.fully_shard")
    mp = ctx.mp_policy()
    for i in range(cfg.num_hidden_layers):
        sch[f"model.layers.{i}"].fully_shard(reshard_after_forward=reshard, mp_policy=mp)
    sch.fully_shard(mp_policy=mp)
    optimizer, kwargs = _schedlang_optimizer(ctx, fused_triton)
    model, opt = build(sch, optimizer=optimizer, **kwargs)
    del sch  # the schedule holds the unsharded original; let it go before the timed steps
    _compile_layers(ctx, model)

    def loss_fn(ids, labels):
        return _plain_loss(model(input_ids=ids, use_cache=False).logits, labels)

    return Setup(model, opt, loss_fn, dp=ctx.world, tp=1, dp_rank=mesh.get_local_rank("dp"))


def make_schedlang_tp(ctx: Context, cfg, dp: int, fsdp: bool, fused_triton: bool = False) -> Setup:
    schedlang = _schedlang()
    try:
        from schedlang.distributed.cross_entropy import vocab_parallel_cross_entropy
        from schedlang.models import shard_model
    except ImportError as e:
        raise NotAvailable(f"schedlang.models.shard_model / vocab_parallel_cross_entropy ({e})") from e
    tp = ctx.world // dp
    mesh = ctx.schedlang_mesh(dp, tp)
    sch = schedlang.create_schedule(full_model(cfg, ctx.device), mesh=mesh)
    if tp > 1:
        shard_model(sch)
    if fsdp:
        _need(sch, "fully_shard", "Schedule.fully_shard")
        mp = ctx.mp_policy()
        for i in range(cfg.num_hidden_layers):
            sch[f"model.layers.{i}"].fully_shard(mp_policy=mp)
        sch.fully_shard(mp_policy=mp)
    optimizer, kwargs = _schedlang_optimizer(ctx, fused_triton)
    model, opt = schedlang.build(sch, optimizer=optimizer, **kwargs)
    del sch
    _compile_layers(ctx, model)
    group = mesh["tp"].get_group()
    vocab = cfg.vocab_size
    # FSDP2 casts to bf16 itself; tensor parallelism alone computes under autocast (fp32 master weights)
    amp = contextlib.nullcontext if fsdp else ctx.autocast

    def loss_fn(ids, labels):
        with amp():
            logits = model(input_ids=ids, use_cache=False).logits
        if logits.shape[-1] != vocab:  # split along the vocabulary: the vocabulary-parallel loss
            return vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), group=group)
        return _plain_loss(logits, labels)

    return Setup(model, opt, loss_fn, dp=dp, tp=tp, dp_rank=mesh.get_local_rank("dp"))


def make_variant(ctx: Context, name: str, cfg) -> Setup:
    tp2d = ctx.args.tp2d
    if name in ("tp-fsdp-titan", "schedlang-tp-fsdp") and ctx.world % tp2d:
        raise ValueError(f"{name}: --tp2d {tp2d} does not divide the world of {ctx.world} ranks")
    if name == "fsdp2-titan":
        return make_fsdp2_titan(ctx, cfg)
    if name == "tp-titan":
        return make_tp_titan(ctx, cfg, dp=1)
    if name == "tp-fsdp-titan":
        return make_tp_titan(ctx, cfg, dp=ctx.world // tp2d, fsdp=True)
    if name.startswith("schedlang-fsdp"):
        rest = set(name.split("-")[2:])
        if not rest <= {"noreshard", "fusedadamw"}:
            raise ValueError(f"unknown variant {name!r}")
        return make_schedlang_fsdp(ctx, cfg, reshard=False if "noreshard" in rest else None,
                                   fused_triton="fusedadamw" in rest)
    if name == "schedlang-tp":
        return make_schedlang_tp(ctx, cfg, dp=1, fsdp=False)
    if name == "schedlang-tp-fusedadamw":
        return make_schedlang_tp(ctx, cfg, dp=1, fsdp=False, fused_triton=True)
    if name == "schedlang-tp-fsdp":
        return make_schedlang_tp(ctx, cfg, dp=ctx.world // tp2d, fsdp=True)
    raise ValueError(f"unknown variant {name!r}: valid are {', '.join(BASELINES + SCHEDLANG)}, "
                     "schedlang-tp-fusedadamw")


# -------------------------------------------------------------------------------------------- measuring
def global_batch(cfg, args, world, device):
    """``batch x world`` rows of ``seq`` token ids and their labels (the ids shifted by one, the last position
    ignored), made on the host from a fixed seed, the same on every rank."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch * world, args.seq), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    return ids.to(device), labels.to(device)


def rows_of(t: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    n = t.shape[0] // parts
    return t[part * n:(part + 1) * n]


def world_mean(value: torch.Tensor, device) -> float:
    """Mean over all ranks (a tensor-parallel group holds one value several times, so this is the mean over
    the data-parallel ranks, each of which trains on the same number of tokens)."""
    DTensor = _dtensor_cls()
    v = value.detach()
    if isinstance(v, DTensor):
        v = v.full_tensor()
    v = v.float().reshape(()).to(device).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(v)
        v /= dist.get_world_size()
    return float(v)


def global_grad_norm(params) -> float:
    """L2 norm of the whole gradient across every layout: a DTensor's sum of squares is reduced over its mesh,
    a plain tensor's is this rank's (plain gradients are replicated over the ranks that hold them)."""
    import logging

    DTensor = _dtensor_cls()
    # a 2-D (dp x tp) partial sum is reduced one dimension at a time; DTensor warns about that each time
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    total = 0.0
    for p in params:
        g = p.grad
        if g is None:
            continue
        sq = g.float().pow(2).sum()
        if isinstance(sq, DTensor):
            sq = sq.full_tensor()
        total += float(sq)
    return math.sqrt(total)


def reference_loss(cfg, ids, labels, ctx: Context) -> Dict[str, Any]:
    """The plain model, eager, on this rank's share of the global batch; the mean over ranks."""
    model = full_model(cfg, ctx.device)
    n_params = sum(p.numel() for p in model.parameters())
    rank = dist.get_rank() if dist.is_initialized() else 0
    with torch.no_grad(), ctx.autocast():
        logits = model(input_ids=rows_of(ids, rank, ctx.world), use_cache=False).logits
        loss = _plain_loss(logits, rows_of(labels, rank, ctx.world))
    value = world_mean(loss, ctx.device)
    del model, logits, loss
    harness.free_memory(ctx.device)
    return {"loss": value, "n_params": n_params}


def run_variant(ctx: Context, work: str, name: str, cfg, ids, labels) -> Dict[str, Any]:
    setup = make_variant(ctx, name, cfg)
    local_ids = rows_of(ids, setup.dp_rank, setup.dp)
    local_labels = rows_of(labels, setup.dp_rank, setup.dp)
    model, opt, loss_fn = setup.model, setup.opt, setup.loss_fn
    backward = getattr(loss_fn, "backward", lambda loss: loss.backward())
    params = [p for p in model.parameters() if p.requires_grad]
    harness.free_memory(ctx.device)
    harness.reset_peak_memory(ctx.device)
    record: Dict[str, Any] = {"losses": []}

    def step(first: bool = False, keep: bool = False):
        loss = loss_fn(local_ids, local_labels)
        backward(loss)
        if first:
            record["grad_norm"] = global_grad_norm(params)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if keep:
            record["losses"].append(world_mean(loss, ctx.device))

    t0 = time.perf_counter()
    for i in range(ctx.args.warmup):
        step(first=i == 0, keep=True)
    harness._synchronize(ctx.device)
    warm_s = time.perf_counter() - t0
    timing = harness.time_steps(step, ctx.device, warmup=0, repeats=ctx.args.repeats, iters=ctx.args.iters)
    timing["warmup_s"] = round(warm_s, 2)
    mem = harness.peak_memory_gib(ctx.device)
    layout = f"dp={setup.dp} x tp={setup.tp}"
    del setup, model, opt, loss_fn, params, step
    return {"timing": timing, "mem": mem, "record": record, "layout": layout}


def check(record, ref_loss: float, anchor: Optional[dict], tol) -> Dict[str, Any]:
    """"ok" or "FAIL <why>" (see the module docstring), and the figures it compared."""
    problems = []
    first = record["losses"][0] if record["losses"] else float("nan")
    if not abs(first - ref_loss) <= tol["loss"] * abs(ref_loss):
        problems.append(f"first loss {first:.4f} vs eager {ref_loss:.4f}")
    if anchor is not None:
        a_gn, gn = anchor["grad_norm"], record["grad_norm"]
        if not abs(gn - a_gn) <= tol["grad_norm"] * abs(a_gn):
            problems.append(f"grad norm {gn:.4g} vs {anchor['variant']} {a_gn:.4g}")
        a_last, last = anchor["losses"][-1], record["losses"][-1]
        if not abs(last - a_last) <= tol["trajectory"] * abs(a_last):
            problems.append(f"loss after {len(record['losses'])} steps {last:.4f} vs {anchor['variant']} {a_last:.4f}")
    if any(not math.isfinite(x) for x in record["losses"] + [record["grad_norm"]]):
        problems.append("non-finite loss or gradient")
    return {"check": "ok" if not problems else "FAIL " + "; ".join(problems),
            "loss_first": round(first, 5), "loss_eager": round(ref_loss, 5),
            "grad_norm": round(record["grad_norm"], 5), "losses": [round(x, 5) for x in record["losses"]]}


def role_of(name: str) -> str:
    return "schedlang" if name.startswith("schedlang") else "baseline"


def run_work(ctx: Context, work: str, variants: List[str]) -> List[dict]:
    args, device, world = ctx.args, ctx.device, ctx.world
    rank = dist.get_rank() if dist.is_initialized() else 0
    cfg = llama_config(work, args)
    ids, labels = global_batch(cfg, args, world, device)
    ref = reference_loss(cfg, ids, labels, ctx)
    tokens = ids.numel()
    flops = harness.transformer_train_flops(ref["n_params"], cfg.num_hidden_layers, cfg.hidden_size, args.seq, tokens)
    gpus = world if ctx.cuda else 0
    tol = TOL_BF16 if ctx.bf16 else TOL_FP32
    common = {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "params": ref["n_params"],
              "batch_per_gpu": args.batch, "global_batch": args.batch * world, "seq": args.seq,
              "compiled": bool(args.compile)}
    if rank == 0:
        print(f"\n== {work}: {cfg.num_hidden_layers} layers, {ref['n_params'] / 1e9:.2f}B parameters, global batch "
              f"{args.batch * world} x {args.seq} on {world} ranks; eager reference loss {ref['loss']:.4f}",
              flush=True)
    rows, anchor = [], None
    for name in variants:
        role = role_of(name)
        try:
            out = run_variant(ctx, work, name, cfg, ids, labels)
            rec = out["record"]
            verdict = check(rec, ref["loss"], anchor, tol)
            if anchor is None and verdict["check"] == "ok":
                anchor = {"variant": name, **rec}
            row = harness.make_row(work, name, role, out["timing"]["ms"], tokens, flops, gpus, out["mem"],
                                   verdict.pop("check"), layout=out["layout"], ms_runs=out["timing"]["ms_runs"],
                                   warmup_s=out["timing"]["warmup_s"], **verdict, **common)
        except NotAvailable as e:
            row = harness.failed_row(work, name, role, f"FAIL: not available: {e}", **common)
        except Exception as e:  # record and go on with the next variant
            if rank == 0:
                traceback.print_exc()
            row = harness.failed_row(work, name, role, e, **common)
        rows.append(row)
        if rank == 0:
            print(harness.text_table([row]).splitlines()[1], flush=True)
        # every variant compiles from scratch, and leaves nothing behind on the GPU
        torch._dynamo.reset()
        harness.free_memory(device)
        if dist.is_initialized():
            dist.barrier()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--works", default=",".join(WORKS), help=f"comma-separated, from {', '.join(WORKS)}")
    parser.add_argument("--variants", default=None,
                        help="comma-separated (default: each work's list); from " + ", ".join(BASELINES + SCHEDLANG))
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU (the global batch is batch x world)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers-8b", type=int, default=8, help="decoder layers of llama-8b-layers")
    parser.add_argument("--tp2d", type=int, default=2, help="tensor-parallel size of the 2-D (dp x tp) variants")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps (compilation; their losses are checked)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")
    parser.add_argument("--iters", type=int, default=5, help="steps per timed repeat")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compile each decoder block (default: yes, except with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="2-layer models on CPU ranks (gloo): checks the script")
    parser.add_argument("--name", default=None, help="result file name (default: scale, scale-tiny with --tiny)")
    parser.add_argument("--results-dir", default=None, help="where the JSON goes (default: bench/results)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 32)
        args.repeats, args.iters = min(args.repeats, 2), min(args.iters, 2)
    if args.compile is None:
        args.compile = not args.tiny
    use_cuda = torch.cuda.is_available() and not args.tiny
    if use_cuda:
        # NVLink multicast (NVLS) off for NCCL and symmetric memory, as on the machines the figures come from
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # schedlang's Triton AdamW on the CPU (--tiny)
        device = torch.device("cpu")
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=900),
                                **({"device_id": device} if use_cuda else {}))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    works = [w.strip() for w in args.works.split(",") if w.strip()]
    for w in works:
        if w not in WORKS:
            parser.error(f"unknown work {w!r}: valid are {', '.join(WORKS)}")
    ctx = Context(args, device, world)
    rows: List[dict] = []
    for work in works:
        variants = ([v.strip() for v in args.variants.split(",") if v.strip()] if args.variants
                    else list(DEFAULT_VARIANTS[work]))
        rows += run_work(ctx, work, variants)
    if rank == 0:
        name = args.name or ("scale-tiny" if args.tiny else "scale")
        path = harness.write_results(name, rows, gpus=world if use_cuda else 0,
                                     directory=Path(args.results_dir) if args.results_dir else None,
                                     ranks=world, peak_flops_per_gpu=harness.PEAK_BF16_FLOPS,
                                     command=" ".join(["bench/bench_scale.py"] + sys.argv[1:]))
        print(f"\n{world} ranks, {harness.environment(world if use_cuda else 0)['device']}, torch {torch.__version__}")
        print(harness.text_table(rows))
        print(f"\nwrote {path}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()

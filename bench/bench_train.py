"""End-to-end training step: schedlang against PyTorch's own tools applied well, like for like.

    python bench/bench_train.py --work llama-1.1b-1gpu
    python bench/bench_train.py --work gpt2-medium-1gpu
    python bench/bench_train.py --work llama-1.1b-1gpu-fp8          # needs torchao
    torchrun --nproc_per_node=2 bench/bench_train.py --work llama-1.1b-tp2
    torchrun --nproc_per_node=2 bench/bench_train.py --work llama-1.1b-2gpu
    torchrun --nproc_per_node=2 bench/bench_train.py --work llama-1.1b-2gpu-fp8     # needs torchao
    python bench/bench_train.py --work llama-1.1b-1gpu --optimizer schedlang-fused
    python bench/bench_train.py                                      # every 1-GPU work
    python bench/bench_train.py --tiny                               # every 1-process work on the CPU, seconds

A work is a model, a batch and a number of GPUs; its variants run one after the other in one
process (one per GPU under torchrun), like for like: the same weights (HF's init from seed 0), the
same batch (token ids from a fixed seed, labels shifted on the host), ``use_cache=False``, bf16
compute over fp32 weights, and the same optimizer class and kind on every row of a run (column
``optimizer``: ``torch.optim.AdamW(fused=True)`` by default, ``--optimizer schedlang-fused`` for
``schedlang.optim.FusedAdamW`` on both sides; a run with it stores its rows under
``<variant>+FusedAdamW``). Every row names the baseline it is compared with (``baseline``).

Works (batch x seq; ``--batch`` / ``--seq`` override):

* ``llama-1.1b-1gpu``: LLaMA-1.1B (22 layers, hidden 2048, 16 heads, intermediate 5632, vocab
  32000), b4 s2048, 1 GPU; baseline ``titan-style``.
* ``gpt2-medium-1gpu``: GPT-2 medium (24 layers, hidden 1024, vocab 50304), b8 s1024, 1 GPU;
  baseline ``titan-style``.
* ``llama-1.1b-1gpu-fp8``: LLaMA-1.1B with float8 training of the blocks' Linears (torchao,
  tensorwise); baseline ``titan-style-fp8``. Skipped with a message when torchao is missing.
* ``llama-1.1b-1gpu-ckpt``: as ``llama-1.1b-1gpu``, selective activation checkpointing's memory and
  speed; baseline ``schedlang-optimize``.
* ``llama-1.1b-tp2``: tensor parallelism over 2 GPUs, b4 s2048 for the group (as ``tp_titan``);
  baseline ``tp-titan``.
* ``llama-1.1b-2gpu``: 2 GPUs in the best layout, b4 s2048 per GPU (a global batch of 8
  sequences; tensor-parallel variants train on all 8): tokens/s count both GPUs; baseline
  ``fsdp2-titan``.
* ``llama-1.1b-2gpu-fp8``: as ``llama-1.1b-2gpu`` with float8 training of the blocks' Linears (the FSDP2
  layouts all-gather their weights in float8, the DDP ones hold them whole); baseline ``fsdp2-titan-fp8``.
  Skipped with a message when torchao is missing.
* ``llama-8b-layers-2gpu``: LLaMA-3-8B's layer shapes with ``--layers-8b`` layers (default 8),
  2 GPUs, as ``llama-1.1b-2gpu``.
* ``llama-8b-4gpu``: the whole LLaMA-3-8B (32 layers, hidden 4096, 32 heads with 8 key/value heads,
  intermediate 14336, vocab 128256), 4 GPUs, b4 s2048 per GPU (a global batch of 16 sequences);
  its baselines: FSDP2 titan-style, the same with no reshard and bf16 gradient reduction (the native
  row with the numerics of schedlang's best row, its ``baseline``), and 2-D dp2 x tp2 titan-style.

Variants: the baselines are in ``bench/baselines.py`` (``eager``, ``compile``, ``titan-style``,
``titan-style-fp8``, ``dtensor-compile``, ``tp-titan``, ``fsdp2-titan``, ``fsdp2-titan-noreshard`` (torchtitan's
``reshard_after_forward_policy="never"``), ``fsdp2-titan-noreshard-bf16reduce`` (also its
``mixed_precision_reduce="bfloat16"``), ``tp-fsdp-titan``, ``ddp-titan``, ``ddp-titan-fp8``).
schedlang's, through its schedule API:

* ``schedlang-layers``: ``create_schedule`` + ``build`` + ``compile_layers`` (1 GPU: the plan is
  empty; this is schedlang's overhead, if any); the loss as ``titan-style`` takes it;
* ``schedlang-optimize`` (``-fp8``): ``optimize_model(sch)``: fused RMSNorm, fused linear +
  cross-entropy loss (the model called with ``labels=``; the same shifted labels), measured SDPA
  backend, per-layer compile (with ``float8="tensorwise"``);
* ``schedlang-optimize-cg`` (``-fp8-cg``): ``optimize_model(compile="layers-cudagraphs")``: every compiled
  layer replays its kernels from CUDA graphs (torch.compile's cudagraph trees);
* ``schedlang-optimize-ckpt<n>``: ``optimize_model(selective_checkpoint=n)``: every n-th layer
  recomputes its activations in the backward (n = 4, 2, 1): less memory for more time. The work
  ``llama-1.1b-1gpu-ckpt`` measures that curve against ``schedlang-optimize`` (no checkpointing);
* ``schedlang-optimize-mw`` (``-mw-cg``, ``-fp8-mw``, ``-fp8-mw-cg``): as above with fp32 master weights
  for the Linear weights, float8 ones included (``schedlang.optim.master_weight_groups``: bf16
  parameters in the model, fp32 masters in the optimizer), so the step has no weight or gradient casts
  to and from fp32; needs ``--optimizer schedlang-fused`` (the masters live in schedlang's FusedAdamW,
  which every row then uses);
* ``schedlang-tp`` (``-optimize``, ``-optimize-cg``): ``shard_model`` on a ``tp`` mesh (vocabulary-parallel
  embedding, head and cross entropy), ``compile_layers`` (or ``optimize_model``, with per-layer CUDA graphs
  for ``-cg``); the layers' all-reduces are opaque operators inside their graphs;
* ``schedlang-fsdp`` (``-noreshard``, ``-optimize``): ``fully_shard`` per layer and at the root with
  the bf16/fp32 ``MixedPrecisionPolicy``, ``compile_layers`` (or ``optimize_model``);
* ``schedlang-fsdp-fp8`` (``-optimize``): the same after ``float8(fsdp_float8_all_gather=True)`` on every
  layer (``build`` stores the weights' float8 scales after each step);
* ``schedlang-tp-fsdp``: ``shard_model`` then ``fully_shard`` on a ``dp x tp`` mesh (``--tp2d``);
* ``schedlang-fsdp-noreshard-optimize``: ``schedlang-fsdp-optimize`` keeping each layer's gathered
  parameters from its forward to its backward (one all-gather per layer and step instead of two);
  ``-bf16reduce``: with the gradients reduce-scattered in bf16 (half the bytes; the sum of the ranks'
  bf16 gradients is rounded to bf16 once, as ``schedlang-ddp-optimize-mw-bf16reduce``'s all-reduce
  does; compare it with ``fsdp2-titan-noreshard-bf16reduce``, the native step with the same reduction);
* ``schedlang-train-default``: the trainer's default path (``bench/train_default.py``): what
  ``torchrun --nproc_per_node=2 -m schedlang.train --config 1b --global-batch 8 --seq 2048`` builds and steps,
  with no other flag (on 2 GPUs ``--layout auto`` chooses), on the work's model, batch and weights;
* ``schedlang-optimize-mw-graph``: ``schedlang-optimize-mw`` with the whole step (forward, backward and the
  FusedAdamW step) replayed from one CUDA graph (``schedlang.CapturedStep``) after eager warm-up steps: the
  host issues a step in one replay instead of ~1,300 launches, and the GPU has no gaps waiting on it;
  ``-mw-graph-pdl`` and ``-mw-graph-pdl-mixtune`` (``-cdt``) combine it with the Inductor options below;
  ``-mw-graph-pdl-mixtune-body`` compiles the model's body as one graph instead of each layer on its own, so
  the compiler can fuse across the layers' boundaries (an experiment: its causal mask and rotary cos / sin are
  kept eager by patching the model family's module in this process, see ``_compile_body``);
  ``schedlang-optimize-fp8-mw-graph`` (``-pdl``): the float8 step replayed whole from one graph the same way
  (its layers compiled without graphs of their own: the whole-step capture records their kernels itself);
* ``schedlang-optimize-mw-proj``: ``schedlang-optimize-mw`` with ``optimize_model(fuse_projections=True)``: in
  the compiled layers q|k|v and gate|up run as one GEMM each, on weights concatenated per call;
  ``-mw-cdt`` (``-mw-proj-cdt``): with Inductor's coordinate-descent tuning of its kernels' block sizes
  (``compile_options={"options": {"coordinate_descent_tuning": True}}``); ``-mw-autotune``: Inductor's
  max-autotune of the layers' GEMMs (cuBLAS against Triton templates with fused epilogues, ``TUNING``);
  ``schedlang-optimize-fp8-mw-cg`` takes the same suffixes for Inductor's options (combined, e.g. ``-pw-cdt``):
  ``-cdt``, ``-pw`` (``max_autotune_pointwise``: more block shapes tried for its pointwise kernels, such as
  the float8 casts that write a transposed copy), ``-nd`` (``prefer_nd_tiling``: its pointwise kernels tiled in
  up to three dimensions, for the casts that also write a transposed copy), and ``-bp-nd`` / ``-tma-nd`` (its experimental
  block-pointer / tensor-descriptor code with n-dimensional tiling; both failed the gradient check on
  torch 2.11, so they stay measurements, not options to use); ``-mw-pdl``: Inductor's programmatic dependent
  launch (a kernel's start overlaps the tail of the one before it, Hopper); ``-mw-nomix``: without its
  mix-order reductions (a norm's weight-gradient column sums fused into a row-reduction kernel);
  ``-mw-mixtune``: with them, their split into partial sums autotuned (fewer partial rows leave less for
  the eager sum that finishes them); ``-mw-graph-pdl-mix32`` / ``-mix64``: that split fixed at 32 or 64 rows
  (Inductor's default on an H200 is 16: 512 partial rows per sum, which eager ``sum(dim=0)`` takes 16 us for); ``-mw-tritonmm``: every GEMM of the layers as one of Inductor's Triton
  templates (persistent TMA ones included), into whose prologues and epilogues Inductor can take the
  pointwise work around them (the norms' scaling and casts, SwiGLU, residual adds): the GEMM fusion
  cuBLAS cannot do, at the templates' speed;
* ``schedlang-optimize-mw-knorm``: ``schedlang-optimize-mw`` with ``optimize_model(compiled_norms="kernel")``:
  the compiled layers' RMSNorms call schedlang's kernels as custom operators instead of Inductor's code;
* ``schedlang-optimize-mw-overlap``: ``schedlang-optimize-mw`` with one FusedAdamW per decoder layer, each
  stepped on a side stream as soon as the backward has accumulated its layer's gradients, beside the
  backward of the layers before it (``LayerwiseOverlappedAdamW``);
* ``schedlang-ddp-optimize-mw`` (``-bf16reduce``): ``replicate`` at the root, ``optimize_model`` and
  ``build(optimizer="adamw", master_weights=True)``: DDP over bf16 Linear weights whose fp32 masters live
  in FusedAdamW, gradients all-reduced during the backward in fp32 (the default ``reduce_dtype``), or in
  bf16 with ``-bf16reduce`` (over 2 ranks the two sums are bit-identical: halving is exact and a sum of
  two bf16 values is rounded once either way); needs ``--optimizer schedlang-fused``, as the other
  master-weights rows. ``schedlang-ddp-optimize-fp8-mw``: the same with ``optimize_model(float8="tensorwise")``
  (the compiled layers' Linears in float8, their fp32 masters in FusedAdamW).

Correctness, in the same run (column ``check``: "ok" or "FAIL <why>"): each rank first runs the
plain model eagerly on its share of the batch, forward and backward; every variant's first-step loss
must match it (1e-2 relative in bf16, 1e-4 in fp32), and so must the direction of its first gradient
(``grad_cosine``: the cosine of random projections of both gradients, per parameter, at least 0.98 in
bf16, 0.97 for the 32-layer ``llama-8b-4gpu``, 0.9999 in fp32, 0.8 for the float8 works; at a random initialization the loss and the gradient norm hardly depend on the
labels, the gradient's direction does); its gradient norm after the first backward and its loss at each
warm-up step after the first must match the work's first variant that passed (5% / 2%). A variant that fails
records "FAIL <error>" and the others still run.

Timing: ``--warmup`` steps, then ``--repeats`` repeats of ``--iters`` steps between CUDA events;
``ms`` is the median repeat, all repeats are in ``ms_runs``; with ``--rounds N`` the variants run N times in
turn (A B A B ...) and ``ms`` is the median of the rounds' medians (``ms_rounds``), the typical case where a
machine's collectives drift between runs; ``host_ms`` is the host's time to issue
a step (``bench/harness.py``). MFU at 989 TFLOP/s per GPU. ``--profile DIR`` also writes a
torch.profiler trace of 3 steps of every variant, and on a GPU each row gets ``profile``: those
steps' GPU time by kernel kind (``bench/profile_summary.py``), which ``bench/render_readme.py``
shows. Results: a table on rank 0 and
``bench/results/<date>-train.json`` (``-train-tiny`` with ``--tiny``), rows of the same day merged.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # schedlang from this checkout, uninstalled
import baselines as B  # noqa: E402  (bench/baselines.py)
import harness  # noqa: E402  (bench/harness.py)


@dataclass(frozen=True)
class Work:
    family: str  # "llama" | "gpt2"
    shape: str  # "llama-1.1b" | "llama-8b" | "gpt2-medium"
    batch: int
    seq: int
    world: int  # GPUs (ranks) it needs
    data_parallel: bool  # the global batch is batch x world (else batch for the whole group)
    baseline: str
    variants: Tuple[str, ...]
    needs: Optional[str] = None  # a module it cannot run without
    float8: bool = False  # its variants train in float8: their gradients are further from the eager bf16 ones
    layers: Optional[int] = None  # decoder layers of a llama-8b shape (default: --layers-8b)
    grad_cosine: Optional[float] = None  # the first gradient's least cosine with eager's, where not the dtype's


ONE_GPU = ("eager", "compile", "titan-style", "schedlang-layers", "schedlang-optimize", "schedlang-optimize-cg")
WORKS: Dict[str, Work] = {
    "llama-1.1b-1gpu": Work("llama", "llama-1.1b", 4, 2048, 1, True, "titan-style", ONE_GPU),
    "gpt2-medium-1gpu": Work("gpt2", "gpt2-medium", 8, 1024, 1, True, "titan-style", ONE_GPU),
    "llama-1.1b-1gpu-fp8": Work("llama", "llama-1.1b", 4, 2048, 1, True, "titan-style-fp8",
                                ("titan-style-fp8", "schedlang-optimize-fp8", "schedlang-optimize-fp8-cg"),
                                needs="torchao", float8=True),
    # the memory / speed curve of selective activation checkpointing (every n-th layer recomputed)
    "llama-1.1b-1gpu-ckpt": Work("llama", "llama-1.1b", 4, 2048, 1, True, "schedlang-optimize",
                                 ("schedlang-optimize", "schedlang-optimize-ckpt4", "schedlang-optimize-ckpt2",
                                  "schedlang-optimize-ckpt1")),
    "llama-1.1b-tp2": Work("llama", "llama-1.1b", 4, 2048, 2, False, "tp-titan",
                           ("dtensor-compile", "tp-titan", "schedlang-tp", "schedlang-tp-optimize")),
    "llama-1.1b-2gpu": Work("llama", "llama-1.1b", 4, 2048, 2, True, "fsdp2-titan",
                            ("fsdp2-titan", "fsdp2-titan-noreshard", "ddp-titan", "tp-titan", "schedlang-fsdp",
                             "schedlang-fsdp-noreshard",
                             "schedlang-fsdp-optimize", "schedlang-fsdp-noreshard-optimize-bf16reduce",
                             "schedlang-ddp-optimize-mw", "schedlang-tp", "schedlang-train-default")),
    "llama-1.1b-2gpu-fp8": Work("llama", "llama-1.1b", 4, 2048, 2, True, "fsdp2-titan-fp8",
                                ("fsdp2-titan-fp8", "ddp-titan-fp8", "schedlang-fsdp-fp8", "schedlang-fsdp-fp8-optimize",
                                 "schedlang-ddp-optimize-fp8-mw"),
                                needs="torchao", float8=True),
    "llama-8b-layers-2gpu": Work("llama", "llama-8b", 4, 2048, 2, True, "fsdp2-titan",
                                 ("fsdp2-titan", "tp-titan", "tp-fsdp-titan", "schedlang-fsdp",
                                  "schedlang-fsdp-noreshard", "schedlang-tp", "schedlang-tp-fsdp")),
    # the size people train: the whole LLaMA-3-8B (32 layers) on 4 GPUs, 4 sequences of 2048 per GPU
    "llama-8b-4gpu": Work("llama", "llama-8b", 4, 2048, 4, True, "fsdp2-titan-noreshard-bf16reduce",
                          ("fsdp2-titan", "fsdp2-titan-noreshard-bf16reduce", "tp-fsdp-titan",
                           "schedlang-fsdp-noreshard-optimize-bf16reduce", "schedlang-tp-fsdp"), layers=32,
                          # 32 bf16 layers move the first gradient further from the eager bf16 one than 22 do: every
                          # native baseline of this work measured a cosine of about 0.977 on 4 x H200 (wrong labels:
                          # 0.14 to 0.37, bench/results/2026-11-27-grad-direction.json)
                          grad_cosine=0.97),
}
CHECKPOINT_STRIDES = (4, 2, 1)
# Inductor options of the variants named by these suffixes (a variant may combine several): -cdt, block sizes
# tuned by coordinate descent; -autotune, every GEMM benchmarked against Triton templates (persistent TMA ones
# on Hopper) that can take the following pointwise ops into their epilogue, cuBLAS kept where it is faster;
# -pw, more block shapes tried for pointwise kernels; -nd / -bp / -tma, n-dimensional tiling, block pointers,
# tensor descriptors (experimental in Inductor); -pdl, programmatic dependent launch; -nomix, no mix-order
# reductions; -mixtune, their split autotuned; -mix32 / -mix64, their split fixed at 32 / 64 rows per partial sum
# (fewer partial rows for the eager sums that finish them); -tritonmm, every GEMM a Triton template (no cuBLAS)
TUNING = {"cdt": {"coordinate_descent_tuning": True},
          "autotune": {"max_autotune": True, "triton.enable_persistent_tma_matmul": True},
          "pw": {"max_autotune_pointwise": True},
          "nd": {"triton.prefer_nd_tiling": True},
          "bp": {"triton.use_block_ptr": True},
          "tma": {"triton.use_tensor_descriptor": True, "assume_aligned_inputs": True},
          "pdl": {"triton.enable_pdl": True},
          "nomix": {"triton.mix_order_reduction": False},
          "mixtune": {"triton.mix_order_reduction_autotune_split_size": True},
          "mix32": {"triton.mix_order_reduction_split_size": 32},
          "mix64": {"triton.mix_order_reduction_split_size": 64},
          "tritonmm": {"max_autotune": True, "max_autotune_gemm_backends": "TRITON",
                       "triton.enable_persistent_tma_matmul": True}}
# schedlang-optimize[-fp8][-mw][-cg]: float8 Linears, fp32 master weights, per-layer CUDA graphs
OPTIMIZE_VARIANTS = tuple("schedlang-optimize" + fp8 + mw + cg for fp8 in ("", "-fp8") for mw in ("", "-mw")
                          for cg in ("", "-cg")) + tuple(
    "schedlang-optimize-mw" + extra
    for extra in ("-graph", "-proj", "-cdt", "-proj-cdt", "-knorm", "-autotune", "-overlap", "-pdl", "-nomix",
                  "-mixtune", "-tritonmm", "-graph-pdl", "-graph-pdl-mixtune", "-graph-pdl-mix32",
                  "-graph-pdl-mix64", "-graph-pdl-mixtune-body", "-graph-pdl-mixtune-cdt")) + tuple(
    "schedlang-optimize-fp8-mw-cg" + extra for extra in ("-cdt", "-pw", "-pw-cdt", "-nd", "-bp-nd", "-tma-nd")) + (
    "schedlang-optimize-fp8-mw-graph", "schedlang-optimize-fp8-mw-graph-pdl")
SCHEDLANG = ("schedlang-layers", *OPTIMIZE_VARIANTS, *(f"schedlang-optimize-ckpt{n}" for n in CHECKPOINT_STRIDES),
             "schedlang-tp",
             "schedlang-tp-optimize", "schedlang-tp-optimize-cg", "schedlang-fsdp", "schedlang-fsdp-noreshard", "schedlang-fsdp-optimize",
             "schedlang-fsdp-noreshard-optimize", "schedlang-fsdp-noreshard-optimize-bf16reduce", "schedlang-fsdp-fp8", "schedlang-fsdp-fp8-optimize", "schedlang-tp-fsdp",
             "schedlang-ddp-optimize-mw", "schedlang-ddp-optimize-mw-bf16reduce", "schedlang-ddp-optimize-fp8-mw",
             "schedlang-train-default")
PROFILE_STEPS = 3
OPTIMIZER_SUFFIX = {"torch-fused": "", "schedlang-fused": "+FusedAdamW"}


# ----------------------------------------------------------------------------------- schedlang variants
def _schedlang_mesh(ctx: B.Context, dp: int, tp: int):
    key = ("schedlang", dp, tp)
    if key not in ctx._meshes:
        from schedlang.distributed.mesh import make_mesh

        ctx._meshes[key] = make_mesh(pp=1, dp=dp, tp=tp, device_type=ctx.device.type)
    return ctx._meshes[key]


def _build(ctx: B.Context, sch):
    """``schedlang.build`` with the run's optimizer (the same class and kind as the baselines')."""
    import schedlang
    from schedlang.distributed.float8_fsdp import precompute_scales_after_step

    model, _ = schedlang.build(sch)
    opt = ctx.optimizer(B.adamw_groups(model))
    # as for an optimizer build makes: float8 all-gathered weights get their scales after each step
    precompute_scales_after_step(model, opt)
    return model, opt


def _compile(ctx: B.Context, model) -> None:
    if ctx.args.compile:
        from schedlang.models import compile_layers

        compile_layers(model)


def _optimize(ctx: B.Context, sch, float8=None, cudagraphs: bool = False, checkpoint_every: int = 0,
              fuse_projections: bool = False, tune_kernels: Sequence[str] = (), kernel_norms: bool = False,
              whole_body: bool = False) -> Dict[str, Any]:
    from schedlang.models import optimize_model

    compile = ("layers-cudagraphs" if cudagraphs and ctx.cuda else "layers") if ctx.args.compile else None
    tuned = ({"options": {k: v for name in tune_kernels for k, v in TUNING[name].items()}}
             if tune_kernels and compile is not None else None)
    if whole_body:  # the body is compiled after build, as one graph (_compile_body); the layers not on their own
        compile, tuned = None, None
    optimize_model(sch, compile=compile, float8=float8, selective_checkpoint=checkpoint_every or None,
                   fuse_projections=fuse_projections and compile is not None, compile_options=tuned,
                   compiled_norms="kernel" if kernel_norms else "inductor")
    return sch.root.metadata["optimize"]


def _labels_loss(ctx: B.Context, model, amp=True):
    """The loss as ``optimize_model``'s fused head takes it: the model called with ``labels=``. HF shifts the
    labels itself (``pad(ids)[1:]`` with -100 last), which is exactly the batch's host-shifted labels."""

    def loss_fn(ids, labels):
        with ctx.autocast() if amp else _null():
            return model(input_ids=ids, labels=ids, use_cache=False).loss

    return loss_fn


def _null():
    import contextlib

    return contextlib.nullcontext()


def make_schedlang_single(ctx: B.Context, cfg, optimize: bool, float8=None, cudagraph_layers: bool = False,
                          checkpoint_every: int = 0, master_weights: bool = False, captured_step: bool = False,
                          fuse_projections: bool = False, tune_kernels: Sequence[str] = (),
                          kernel_norms: bool = False, overlap_optimizer: bool = False,
                          whole_body: bool = False) -> B.Setup:
    import schedlang

    if master_weights:
        _need_master_weights(ctx)
    sch = schedlang.create_schedule(B.full_model(cfg, ctx.device))
    info = (_optimize(ctx, sch, float8, cudagraphs=cudagraph_layers, checkpoint_every=checkpoint_every,
                      fuse_projections=fuse_projections, tune_kernels=tune_kernels, kernel_norms=kernel_norms,
                      whole_body=whole_body)
            if optimize else None)
    if master_weights:
        from schedlang.optim import FusedAdamW, master_weight_groups

        model, _ = schedlang.build(sch)
        opt = (LayerwiseOverlappedAdamW(model, ctx.device, ctx.lr) if overlap_optimizer
               else FusedAdamW(master_weight_groups(model), lr=ctx.lr, weight_decay=0.01))
    else:
        model, opt = _build(ctx, sch)
    del sch  # the schedule holds the original; let it go before the timed steps
    if whole_body and ctx.args.compile:
        _compile_body(model, tune_kernels)
    if optimize:
        setup = B.Setup(model, opt, _labels_loss(ctx, model), notes={"loss": "fused linear + cross entropy (labels=)",
                                                                     "optimize": info,
                                                                     "compile": "body" if whole_body else "layers",
                                                                     "master_weights": master_weights or None})
        if captured_step:
            _capture_whole_step(ctx, setup)
        return setup
    _compile(ctx, model)
    loss_fn = B._head_loss(ctx, B.body(model), model.lm_head)
    return B.Setup(model, opt, loss_fn, notes={"loss": "body -> lm_head -> F.cross_entropy (fp32)",
                                               "compile": "layers"})


def _compile_body(model, tune_kernels: Sequence[str]) -> None:
    """The model's body (embedding, every decoder layer, the final norm) compiled as one graph, in place, with the
    row's Inductor options: the compiler can fuse across the layers' boundaries (a layer's last residual add with
    the next layer's norm; in the backward, the next layer's gradient with its cast to bf16), which layers
    compiled one by one cannot. The schedlang kernels inside it run as their PyTorch references (traced).

    Two parts stay eager, as they are when the layers are compiled one by one: the causal mask (transformers
    builds a full mask while it is traced, which SDPA then applies instead of skipping the masked blocks: three
    times the attention's time, measured) and the rotary embedding's cos / sin (traced, the compiler recomputes
    them inside every layer's rotary kernel)."""
    import sys as _sys

    body = B.body(model)
    rotary = getattr(body, "rotary_emb", None)
    if rotary is not None:
        rotary.forward = torch.compiler.disable(rotary.forward)
    family = _sys.modules[type(body).__module__]
    if hasattr(family, "create_causal_mask"):  # the family's module, for every model of it in this process
        family.create_causal_mask = torch.compiler.disable(family.create_causal_mask)
    options = {k: v for name in tune_kernels for k, v in TUNING[name].items()}
    body.compile(**({"options": options} if options else {}))


class LayerwiseOverlappedAdamW:
    """FusedAdamW over the same master-weight groups, one optimizer per decoder layer plus one for the rest,
    each layer's step launched on a side stream as soon as the backward has accumulated all of that layer's
    gradients, so it runs beside the backward of the layers before it. ``step()`` then steps the rest on
    the main stream and makes the main stream wait for the side stream (the next forward reads the new
    weights). The first backward runs with the hooks off, so the row's gradient check sees every gradient
    before any step; the updates are the same as one FusedAdamW's (AdamW is per element)."""

    def __init__(self, model, device, lr: float = B.LR):
        from schedlang.optim import FusedAdamW, master_weight_groups

        layers = list(B.blocks(model))
        # every group is computed before any optimizer is made: making one turns its weights into bf16
        layer_groups = [master_weight_groups(layer) for layer in layers]
        in_layers = {id(p) for groups in layer_groups for g in groups for p in g["params"]}
        rest_groups = [{**g, "params": [p for p in g["params"] if id(p) not in in_layers]}
                       for g in master_weight_groups(model)]
        rest_groups = [g for g in rest_groups if g["params"]]
        self.layer_optimizers = [FusedAdamW(groups, lr=lr, weight_decay=0.01) for groups in layer_groups]
        self.rest = FusedAdamW(rest_groups, lr=lr, weight_decay=0.01)
        self.device = device
        self.side = None  # the side stream, made at the first overlapped step (a CPU model never needs one)
        self.enabled = False
        self.launched = set()
        self.pending = {}
        self.layers_stepped_in_backward = 0
        for index, opt in enumerate(self.layer_optimizers):
            params = [p for g in opt.param_groups for p in g["params"]]
            for p in params:
                p.register_post_accumulate_grad_hook(self._hook(weakref.ref(self), index, len(params)))

    @property
    def param_groups(self):
        return [g for opt in (*self.layer_optimizers, self.rest) for g in opt.param_groups]

    @staticmethod
    def _hook(owner_ref, index, count):
        # the hook lives on the parameter, which the optimizer holds: a strong reference back to the optimizer
        # would be a cycle through autograd's C++ hook table that Python's collector cannot see, and every
        # master weight and moment would outlive the row
        def hook(_param):
            owner = owner_ref()
            if owner is not None:
                owner._layer_gradient_ready(index, count)
        return hook

    def _layer_gradient_ready(self, index, count):
        if not self.enabled:
            return
        self.pending[index] = self.pending.get(index, 0) + 1
        if self.pending[index] < count:
            return
        if self.side is None:
            self.side = torch.cuda.Stream(self.device)
        opt = self.layer_optimizers[index]
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            opt.step()
        for g in opt.param_groups:
            for p in g["params"]:
                if p.grad is not None:  # the main stream may reuse the gradient's memory only after the step
                    p.grad.record_stream(self.side)
        self.launched.add(index)

    def step(self):
        for index, opt in enumerate(self.layer_optimizers):
            if index not in self.launched:
                opt.step()
        self.rest.step()
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)
        self.layers_stepped_in_backward = len(self.launched)
        self.launched.clear()
        self.pending.clear()
        self.enabled = True

    def zero_grad(self, set_to_none=True):
        for opt in (*self.layer_optimizers, self.rest):
            opt.zero_grad(set_to_none=set_to_none)


def _capture_whole_step(ctx: B.Context, setup: B.Setup) -> None:
    """Replay the whole step (forward, backward, optimizer step) from one CUDA graph (``schedlang.CapturedStep``)
    after eager warm-up steps. The loss path is the row's own, with autocast's cast cache off (a capture must
    not keep the cache's tensors); with master weights no Linear weight is cast anyway."""
    import schedlang

    model = setup.model

    def loss_and_backward(ids, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss

    # the row's first warm-up step is eager outside CapturedStep and the rest go through it: its own eager steps
    # and the capture all fall in the warm-up, so the timed steps are replays and the warm-up losses checked
    # include one from the captured graph
    if ctx.args.warmup < 3:
        raise B.NotAvailable(f"a captured step needs --warmup of at least 3 (an eager step, one through the "
                             f"step before its capture, the capture), got {ctx.args.warmup}")
    if not ctx.cuda:
        raise B.NotAvailable("a captured step replays a CUDA graph: it needs a GPU")
    setup.step = schedlang.CapturedStep(loss_and_backward, setup.opt, warmup=ctx.args.warmup - 2)
    setup.notes["captured_step"] = "forward, backward and FusedAdamW step replayed from one CUDA graph"


def make_schedlang_tp(ctx: B.Context, cfg, dp: int = 1, fsdp: bool = False, optimize: bool = False,
                      cudagraphs: bool = False) -> B.Setup:
    import schedlang
    from schedlang.distributed.cross_entropy import vocab_parallel_cross_entropy
    from schedlang.models import shard_model

    tp = ctx.world // dp
    mesh = _schedlang_mesh(ctx, dp, tp)
    sch = schedlang.create_schedule(B.full_model(cfg, ctx.device), mesh=mesh)
    if tp > 1:
        shard_model(sch)
    if fsdp:
        mp = ctx.mp_policy()
        for path in B.layer_paths(sch.mod):
            sch[path].fully_shard(mp_policy=mp)
        sch.fully_shard(mp_policy=mp)
    info = _optimize(ctx, sch, cudagraphs=cudagraphs) if optimize else None
    model, opt = _build(ctx, sch)
    del sch
    if not optimize:
        _compile(ctx, model)
    group = mesh["tp"].get_group()
    amp = _null if fsdp else ctx.autocast  # FSDP2 casts to bf16 itself

    def loss_fn(ids, labels):
        with amp():
            logits = model(input_ids=ids, use_cache=False).logits
        if logits.shape[-1] != cfg.vocab_size:  # split along the vocabulary: the vocabulary-parallel loss
            return vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), group=group)
        return B.plain_loss(logits, labels)

    return B.Setup(model, opt, loss_fn, dp=dp, tp=tp, dp_rank=mesh.get_local_rank("dp"),
                   notes={"loss": "vocab-split logits -> vocab_parallel_cross_entropy (fp32)", "optimize": info,
                          "compile": "layers"})


def make_schedlang_fsdp(ctx: B.Context, cfg, reshard: Optional[bool], optimize: bool, float8: bool = False,
                        reduce_dtype: torch.dtype = torch.float32) -> B.Setup:
    import schedlang

    mesh = _schedlang_mesh(ctx, ctx.world, 1)
    sch = schedlang.create_schedule(B.full_model(cfg, ctx.device), mesh=mesh)
    if float8:  # every layer's Linears, weights all-gathered in float8 (build stores their scales after each step)
        for path in B.layer_paths(sch.mod):
            # the tiny models' Linears are below the default size floor, where float8 is not worth it
            sch[path].float8(recipe="tensorwise", fsdp_float8_all_gather=True,
                             **({"min_features": 16} if ctx.args.tiny else {}))
    mp = ctx.mp_policy(reduce_dtype)
    for path in B.layer_paths(sch.mod):
        sch[path].fully_shard(reshard_after_forward=reshard, mp_policy=mp)
    sch.fully_shard(mp_policy=mp)
    info = _optimize(ctx, sch) if optimize else None
    model, opt = _build(ctx, sch)
    del sch
    if optimize:
        loss_fn, loss = _labels_loss(ctx, model, amp=False), "fused linear + cross entropy (labels=)"
    else:
        _compile(ctx, model)
        loss = "logits -> F.cross_entropy (fp32)"

        def loss_fn(ids, labels):
            return B.plain_loss(model(input_ids=ids, use_cache=False).logits, labels)

    return B.Setup(model, opt, loss_fn, dp=ctx.world, dp_rank=mesh.get_local_rank("dp"),
                   notes={"loss": loss, "optimize": info, "compile": "layers",
                          "float8": "tensorwise, float8 all-gather" if float8 else None,
                          "reduce_dtype": B.reduce_dtype_name(mp)})


def make_schedlang_ddp(ctx: B.Context, cfg, reduce_dtype: str = "float32", float8: Optional[str] = None
                       ) -> B.Setup:
    """DDP with fp32 master weights: ``replicate`` at the root, ``optimize_model`` (``float8``: its float8 Linears
    in the compiled layers), and build's FusedAdamW keeping the masters of the bf16 Linear weights (the DDP
    engine sees the bf16 parameters)."""
    import schedlang

    _need_master_weights(ctx)
    mesh = _schedlang_mesh(ctx, ctx.world, 1)
    sch = schedlang.create_schedule(B.full_model(cfg, ctx.device), mesh=mesh)
    sch.replicate(mp_policy={"reduce_dtype": reduce_dtype})
    info = _optimize(ctx, sch, float8=float8)
    model, opt = schedlang.build(sch, optimizer="adamw", master_weights=True, lr=ctx.lr, weight_decay=0.01)
    del sch
    return B.Setup(model, opt, _labels_loss(ctx, model), dp=ctx.world, dp_rank=mesh.get_local_rank("dp"),
                   notes={"loss": "fused linear + cross entropy (labels=)", "optimize": info, "compile": "layers",
                          "master_weights": True, "data_parallel": f"replicate (DDP), {reduce_dtype} gradient reduction",
                          "float8": float8})


def _need_master_weights(ctx: B.Context) -> None:
    if ctx.args.optimizer != "schedlang-fused":
        # the fp32 masters live in schedlang's fused AdamW: like for like only when every row uses that class
        raise B.NotAvailable("master weights need schedlang's FusedAdamW on every row: run with "
                             "--optimizer schedlang-fused")
    if not ctx.bf16:
        raise B.NotAvailable("master weights keep bf16 parameters for bf16 compute: a bf16 run (on a GPU) needs "
                             "them; this run computes in fp32")


def make_variant(ctx: B.Context, name: str, cfg) -> B.Setup:
    if name in B.BASELINES:
        return B.BASELINES[name](ctx, cfg)
    if name == "schedlang-layers":
        return make_schedlang_single(ctx, cfg, optimize=False)
    if name in OPTIMIZE_VARIANTS:
        options = set(name[len("schedlang-optimize"):].split("-")[1:])
        return make_schedlang_single(ctx, cfg, optimize=True, float8="tensorwise" if "fp8" in options else None,
                                     cudagraph_layers="cg" in options, master_weights="mw" in options,
                                     captured_step="graph" in options, fuse_projections="proj" in options,
                                     tune_kernels=tuple(sorted(options & set(TUNING))), kernel_norms="knorm" in options,
                                     overlap_optimizer="overlap" in options, whole_body="body" in options)
    if name.startswith("schedlang-optimize-ckpt") and name in SCHEDLANG:
        return make_schedlang_single(ctx, cfg, optimize=True, checkpoint_every=int(name.rpartition("ckpt")[2]))
    if name in ("schedlang-tp", "schedlang-tp-optimize", "schedlang-tp-optimize-cg"):
        return make_schedlang_tp(ctx, cfg, optimize="optimize" in name, cudagraphs=name.endswith("-cg"))
    if name.startswith("schedlang-ddp-optimize-") and name in SCHEDLANG:
        return make_schedlang_ddp(ctx, cfg, reduce_dtype="bfloat16" if name.endswith("-bf16reduce") else "float32",
                                  float8="tensorwise" if "-fp8" in name else None)
    if name == "schedlang-tp-fsdp":
        return make_schedlang_tp(ctx, cfg, dp=ctx.world // ctx.args.tp2d, fsdp=True)
    if name == "schedlang-train-default":  # the trainer's default path (bench/train_default.py)
        from train_default import make_trainer_default

        rows = ctx.batch_rows
        return make_trainer_default(ctx, cfg, global_batch=rows, seq=ctx.seq)
    if name.startswith("schedlang-fsdp"):
        return make_schedlang_fsdp(ctx, cfg, reshard=False if "noreshard" in name else None,
                                   optimize="-optimize" in name, float8="-fp8" in name,
                                   reduce_dtype=torch.bfloat16 if name.endswith("-bf16reduce") else torch.float32)
    raise ValueError(f"unknown variant {name!r}: valid are {', '.join(list(B.BASELINES) + list(SCHEDLANG))}")


# -------------------------------------------------------------------------------------------- measuring
def reference_loss(ctx: B.Context, cfg, ids, labels) -> Dict[str, Any]:
    """The plain model, eager, on this rank's share of the global batch: the loss (the mean over ranks) and the
    fingerprint of its gradient (:func:`harness.grad_fingerprint`, the mean over ranks: the whole batch's)."""
    model = B.full_model(cfg, ctx.device)
    n_params = sum(p.numel() for p in model.parameters())
    rank = dist.get_rank() if dist.is_initialized() else 0
    with ctx.autocast():
        logits = model(input_ids=harness.rows_of(ids, rank, ctx.world), use_cache=False).logits
        loss = B.plain_loss(logits, harness.rows_of(labels, rank, ctx.world))
    del logits
    loss.backward()
    value = harness.world_mean(loss.detach(), ctx.device)
    fingerprint = harness.world_mean_fingerprint(harness.grad_fingerprint(model.named_parameters()), ctx.device)
    del model, loss
    harness.free_memory(ctx.device)
    return {"loss": value, "n_params": n_params, "fingerprint": fingerprint}


def run_variant(ctx: B.Context, name: str, cfg, ids, labels, profile: bool = True) -> Dict[str, Any]:
    setup = make_variant(ctx, name, cfg)
    local_ids = harness.rows_of(ids, setup.dp_rank, setup.dp)
    local_labels = harness.rows_of(labels, setup.dp_rank, setup.dp)
    params = [p for p in setup.model.parameters() if p.requires_grad]
    harness.free_memory(ctx.device)
    harness.reset_peak_memory(ctx.device)
    record: Dict[str, Any] = {"losses": []}

    def step(first: bool = False, keep: bool = False):
        if setup.step is not None and not first:  # the whole step, from its CUDA graph once captured
            loss = setup.step(local_ids, local_labels)
        else:  # the first step is eager everywhere, so that its gradients can be checked
            loss = setup.loss_fn(local_ids, local_labels)
            setup.backward(loss)
            if first:
                record["grad_norm"] = harness.global_grad_norm(params)
                record["fingerprint"] = harness.grad_fingerprint(setup.model.named_parameters())
            setup.opt.step()
            setup.opt.zero_grad(set_to_none=True)
        if keep:
            record["losses"].append(harness.world_mean(loss, ctx.device))

    t0 = time.perf_counter()
    for i in range(ctx.args.warmup):
        step(first=i == 0, keep=True)
    harness._synchronize(ctx.device)
    warm_s = time.perf_counter() - t0
    timing = harness.time_steps(step, ctx.device, warmup=0, repeats=ctx.args.repeats, iters=ctx.args.iters)
    timing["warmup_s"] = round(warm_s, 2)
    mem = harness.peak_memory_gib(ctx.device)
    notes = {k: v for k, v in setup.notes.items() if v is not None}
    if ctx.args.profile and profile:
        trace = harness.profile_steps(step, Path(ctx.args.profile), f"{ctx.work_name}-{name}", steps=PROFILE_STEPS)
        if ctx.cuda:  # GPU time by kernel kind, kept with the row (the trace itself stays in DIR)
            import profile_summary

            notes["profile"] = profile_summary.summarize(trace, steps=PROFILE_STEPS, top=12)
    return {"timing": timing, "mem": mem, "record": record, "layout": f"dp={setup.dp} x tp={setup.tp}", "notes": notes}


def run_work(ctx: B.Context, work_name: str, variants: List[str]) -> List[dict]:
    args, device, world = ctx.args, ctx.device, ctx.world
    work = WORKS[work_name]
    ctx.work_name = work_name
    rank = dist.get_rank() if dist.is_initialized() else 0
    suffix = OPTIMIZER_SUFFIX[args.optimizer]
    batch, seq = args.batch or work.batch, args.seq or work.seq
    if args.tiny:
        batch, seq = min(batch, 2), min(seq, 32)
    cfg = B.model_config(work.family, work.shape, args.tiny, layers=work.layers or args.layers_8b, seq=seq)
    rows_global = batch * world if work.data_parallel else batch
    ids, labels = harness.global_batch(cfg.vocab_size, rows_global, seq, device)
    ctx.batch_rows, ctx.seq = rows_global, seq  # the trainer's row takes them as its --global-batch and --seq
    common = {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "batch": rows_global, "seq": seq,
              "optimizer": ctx.optimizer_name(), "lr": ctx.lr, "baseline": work.baseline + suffix,
              "dtype": "bf16 autocast / fp32 weights" if ctx.bf16 else "fp32", "use_cache": False,
              "compiled": bool(args.compile)}
    if work.needs:
        try:
            __import__(work.needs)
        except ImportError as e:
            message = f"{work_name}: skipped, {work.needs} is not installed ({e})"
            if rank == 0:
                print(message, flush=True)
            return [harness.failed_row(work_name, v + suffix, "schedlang" if v in SCHEDLANG else "baseline",
                                       f"FAIL skipped: {work.needs} is not installed", **common) for v in variants]
    ref = reference_loss(ctx, cfg, ids, labels)
    tokens = ids.numel()
    flops = harness.transformer_train_flops(ref["n_params"], cfg.num_hidden_layers, cfg.hidden_size, seq, tokens)
    gpus = world if ctx.cuda else 0
    tol = harness.TOL_BF16 if ctx.bf16 else harness.TOL_FP32
    if work.float8:
        tol = dict(tol, grad_cosine=harness.GRAD_COSINE_FLOAT8)
    if work.grad_cosine is not None and ctx.bf16:
        tol = dict(tol, grad_cosine=work.grad_cosine)
    common["params"] = ref["n_params"]
    if rank == 0:
        print(f"\n== {work_name}: {cfg.num_hidden_layers} layers, {ref['n_params'] / 1e9:.2f}B parameters, batch "
              f"{rows_global} x {seq} on {world} rank(s), {common['optimizer']}; eager reference loss "
              f"{ref['loss']:.4f}", flush=True)
    rows, anchor = [], None
    for round_ in range(args.rounds):  # each round runs every variant once, in the same order
        for name in variants:
            role = "schedlang" if name in SCHEDLANG else "baseline"
            try:
                out = run_variant(ctx, name, cfg, ids, labels, profile=round_ == 0)
                rec = out["record"]
                fingerprint = rec.pop("fingerprint")
                verdict = harness.check_losses(rec["losses"], rec["grad_norm"], ref["loss"], anchor, tol,
                                               fingerprint, ref["fingerprint"])
                if anchor is None and verdict["check"] == "ok":
                    anchor = {"variant": name, **rec}
                row = harness.make_row(work_name, name + suffix, role, out["timing"]["ms"], tokens, flops, gpus,
                                       out["mem"], verdict.pop("check"), layout=out["layout"],
                                       ms_runs=out["timing"]["ms_runs"], host_ms=out["timing"]["host_ms"],
                                       warmup_s=out["timing"]["warmup_s"], gpu_clock=out["timing"]["gpu_clock"],
                                       **out["notes"], **verdict, **common)
            except B.NotAvailable as e:
                row = harness.failed_row(work_name, name + suffix, role, f"FAIL not available: {e}", **common)
            except Exception as e:  # record and go on with the next variant
                if rank == 0:
                    traceback.print_exc()
                row = harness.failed_row(work_name, name + suffix, role, e, **common)
            rows.append(row)
            if rank == 0:
                host = f"  host {row['host_ms']:.1f} ms/step" if row.get("host_ms") is not None else ""
                label = f"  (round {round_ + 1} of {args.rounds})" if args.rounds > 1 else ""
                clock = row.get("gpu_clock")
                clock = (f"  {clock['sm_mhz']:.0f} MHz {clock['power_w']:.0f} W, power-capped {clock['power_capped']:.0%}"
                         + (f", {clock['j_per_step']:.1f} J/step" if clock.get("j_per_step") is not None else "")
                         if clock else "")
                print(harness.text_table(rows).splitlines()[-1] + host + clock + label, flush=True)
            # every variant compiles from scratch, and leaves nothing behind on the GPU
            torch._dynamo.reset()
            harness.free_memory(device)
            if dist.is_initialized():
                dist.barrier()
    return harness.combine_rounds(rows) if args.rounds > 1 else rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default=None,
                        help=f"comma-separated works, from {', '.join(WORKS)} (default: every work of this world "
                             "size; with --tiny, float8 aside)")
    parser.add_argument("--variants", default=None, help="comma-separated (default: the work's list)")
    parser.add_argument("--optimizer", default="torch-fused", choices=sorted(B.OPTIMIZERS),
                        help="the AdamW of every row: torch's fused one or schedlang.optim.FusedAdamW")
    parser.add_argument("--batch", type=int, default=None, help="sequences (per GPU for data-parallel works)")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--lr", type=float, default=B.LR,
                        help="the AdamW learning rate of every row (a larger one makes the loss check after the "
                             "warm-up steps see a wrong update on the tiny models)")
    parser.add_argument("--layers-8b", type=int, default=8, help="decoder layers of llama-8b-layers-2gpu")
    parser.add_argument("--tp2d", type=int, default=2, help="tensor-parallel size of the 2-D (dp x tp) variants")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps (compilation; their losses are checked)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")
    parser.add_argument("--iters", type=int, default=5, help="steps per timed repeat")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the variant list this many times in turn (ABAB...); a row's ms is the median of its "
                             "rounds' medians (ms_rounds), profiles come from the first round")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compile (default: yes, except with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="2-layer models in fp32 on the CPU: checks the script")
    parser.add_argument("--profile", default=None, metavar="DIR", help="also write torch.profiler traces here")
    parser.add_argument("--name", default=None, help="result file name (default: train, train-tiny with --tiny)")
    parser.add_argument("--results-dir", default=None, help="where the JSON goes (default: bench/results)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.repeats, args.iters = min(args.repeats, 2), min(args.iters, 2)
    if args.compile is None:
        args.compile = not args.tiny
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    return parser, args


def main(argv=None) -> List[dict]:
    parser, args = parse_args(argv)
    use_cuda = torch.cuda.is_available() and not args.tiny
    if use_cuda:
        device = harness.local_gpu()
    else:
        if not torch.cuda.is_available():
            # schedlang's Triton kernels on the CPU (--tiny); a GPU machine runs their references instead
            os.environ.setdefault("TRITON_INTERPRET", "1")
        device = torch.device("cpu")
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=900),
                                **({"device_id": device} if use_cuda else {}))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.work:
        works = [w.strip() for w in args.work.split(",") if w.strip()]
    else:  # every work of this world size (float8 aside on the CPU)
        works = [w for w, spec in WORKS.items() if spec.world == world and not (spec.needs and args.tiny)]
    for w in works:
        if w not in WORKS:
            parser.error(f"unknown work {w!r}: valid are {', '.join(WORKS)}")
        if WORKS[w].world != world:
            parser.error(f"{w} runs on {WORKS[w].world} GPU(s) and this is {world} process(es): "
                         + ("torchrun --nproc_per_node=2 bench/bench_train.py --work " + w if WORKS[w].world > 1
                            else f"python bench/bench_train.py --work {w}"))
    ctx = B.Context(args, device, world)
    rows: List[dict] = []
    for work in works:
        variants = ([v.strip() for v in args.variants.split(",") if v.strip()] if args.variants
                    else list(WORKS[work].variants))
        rows += run_work(ctx, work, variants)
    if rank == 0:
        name = args.name or ("train-tiny" if args.tiny else "train")
        path = harness.write_results(name, rows, gpus=world if use_cuda else 0,
                                     directory=Path(args.results_dir) if args.results_dir else None,
                                     ranks=world, peak_flops_per_gpu=harness.PEAK_BF16_FLOPS,
                                     command=" ".join(["bench/bench_train.py"] + (argv if argv is not None
                                                                                   else sys.argv[1:])))
        print(f"\n{world} rank(s), {harness.environment(world if use_cuda else 0)['device']}, torch {torch.__version__}")
        print(harness.text_table(rows))
        print(f"\nwrote {path}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()

"""A mixture-of-experts training step, like for like: schedlang's expert parallelism against transformers'
own expert forward under FSDP2, on the GPUs of this machine.

The model is Qwen3-30B-A3B-shaped (hidden 2048, 32 query / 4 key-value heads of 128, 128 experts of
intermediate 768, top-8 routing, vocabulary 151936) with fewer layers (``--layers``, 4 by default) so that
it trains on one GPU. Every variant starts from the same fp32 weights and takes the same batch, the
model's own loss (transformers' shifted cross-entropy) and the same optimizer (fused AdamW on fp32
master weights), with bf16 compute through FSDP2's mixed precision (parameters in bf16, gradients reduced
in fp32), one FSDP2 unit per decoder layer and one at the root:

* ``hf-loop-fsdp2``: transformers' expert loop (``experts_implementation="eager"``: one expert after
  another, the tokens gathered per expert);
* ``hf-grouped-fsdp2``: transformers' grouped-GEMM expert forward (``experts_implementation="grouped_mm"``,
  its default where ``torch._grouped_mm`` runs), the strongest native row;
* ``schedlang-ep``: ``sch.expert_parallel()`` over the world: tokens sorted by expert, exchanged by
  all-to-all (a no-op exchange on one GPU), the local experts run by the spread module; every expert slice
  is its own FSDP2 unit over the ranks holding the same experts (one rank when ep is the world), its
  gradient divided by the world size as the others are (it arrives summed over the expert-parallel group).

Correctness: the first step's loss of every variant is checked against the first variant's (bf16
tolerance), and so are the norms of that step's gradient and of its expert weights' part. ``python bench/bench_moe.py`` on one GPU or
``torchrun --nproc_per_node=N bench/bench_moe.py`` writes ``<date>-moe-<N>gpu.json`` under
``bench/results/`` (rows, git sha, device and versions). ``--tiny`` runs a small model on the CPU (the
test's smoke run; no result file unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import harness  # noqa: E402  (bench/harness.py)

VARIANTS = ("hf-loop-fsdp2", "hf-grouped-fsdp2", "schedlang-ep")
WORK = "qwen3-moe-a3b-layers"


def model_config(layers: int, tiny: bool):
    from transformers import Qwen3MoeConfig

    if tiny:
        return Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
                              norm_topk_prob=True, output_router_logits=False)
    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, max_position_embeddings=40960,
                          norm_topk_prob=True, output_router_logits=False, tie_word_embeddings=False)


def active_parameters(model: torch.nn.Module, config) -> int:
    """Parameters a token passes through: all but the experts, plus top-k / E of the experts."""
    expert, other = 0, 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            expert += p.numel()
        else:
            other += p.numel()
    return other + expert * config.num_experts_per_tok // config.num_experts


def train_flops(model: torch.nn.Module, config, rows: int, seq: int) -> float:
    """6 x active parameters x tokens, plus causal attention's score and value products (forward and backward)."""
    tokens = rows * seq
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq * tokens
    return 6.0 * active_parameters(model, config) * tokens + attention


def _fsdp_units(model: torch.nn.Module, mesh, replica_mesh, world: int, policy) -> None:
    from torch.distributed.fsdp import fully_shard

    from schedlang.distributed.expert_parallel import ExpertParallelExperts

    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, ExpertParallelExperts):
                # the ranks holding the same experts are the replica group; the gradient arrives summed over
                # the expert-parallel group, so it is divided by the world as every other gradient is
                fully_shard(module, mesh=replica_mesh, mp_policy=policy, reshard_after_forward=False)
                module.set_gradient_divide_factor(float(world))
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def build_variant(variant: str, base: torch.nn.Module, device: torch.device, world: int):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import schedlang

    model = copy.deepcopy(base)
    if variant.startswith("hf-"):
        model.config._experts_implementation = "eager" if variant == "hf-loop-fsdp2" else "grouped_mm"
    model.to(device)
    mesh = DeviceMesh(device.type, torch.arange(world).view(world, 1), mesh_dim_names=("ep", "replica"))
    if variant == "schedlang-ep":
        sch = schedlang.create_schedule(model)
        sch.expert_parallel(mesh["ep"].get_group() if world > 1 else None)
        model = sch.mod
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    _fsdp_units(model, mesh["ep"], mesh["replica"], world, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    return model, opt


def make_step(model, opt, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def first_step(model, opt, ids: torch.Tensor, device: torch.device) -> Dict[str, float]:
    """The loss of the first step (before any update) averaged over the ranks, and the norms of its whole
    gradient and of its expert weights' part alone (a few per mille of the whole in a fresh model: a wrong
    expert gradient would hide in the whole norm)."""
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    # every variant's parameters are split over the world without overlap (FSDP2 shards over all ranks, an
    # expert slice lives on one rank of the expert-parallel group), so the squares of the local pieces sum
    # to the whole gradient's over the world
    squares = torch.zeros(2, dtype=torch.float64, device=device)
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            squares[0 if ".experts." in name else 1] += grad.double().pow(2).sum()
    if dist.get_world_size() > 1:
        dist.all_reduce(squares)
    opt.zero_grad(set_to_none=True)
    return {"loss": harness.world_mean(loss.detach().float(), device), "grad_norm": float(squares.sum().sqrt()),
            "expert_grad_norm": float(squares[0].sqrt())}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a small model on the CPU (smoke run)")
    p.add_argument("--out", default=None, help="results directory (default: bench/results, none under --tiny)")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}: valid are {', '.join(VARIANTS)}")

    launched = "RANK" in os.environ
    device = torch.device("cpu") if args.tiny else harness.local_gpu()
    if not launched:
        # one process: an in-process store, with no port to claim and nothing left in the environment (a caller's
        # later subprocess would inherit a MASTER_PORT and try to listen on it)
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl", store=dist.HashStore(), rank=0,
                                world_size=1)
    elif not dist.is_initialized():
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        config = model_config(args.layers, args.tiny)
        torch.manual_seed(0)
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        seq = 32 if args.tiny else args.seq
        ids = harness.global_batch(config.vocab_size, args.rows * world, seq, device, seed=1)[0]
        local = harness.rows_of(ids, rank, world)
        flops = train_flops(base, config, args.rows * world, seq)
        rows, anchor = [], None
        for variant in variants:
            harness.free_memory(device)
            harness.reset_peak_memory(device)
            model, opt = build_variant(variant, base, device, world)
            check = first_step(model, opt, local, device)
            verdict = "ok"
            if anchor is None:
                anchor = check
            else:
                for key, tol in (("loss", harness.TOL_BF16["loss"]), ("grad_norm", harness.TOL_BF16["grad_norm"]),
                                 ("expert_grad_norm", harness.TOL_BF16["grad_norm"])):
                    if not math.isclose(check[key], anchor[key], rel_tol=tol):
                        verdict = f"{key} {check[key]:.5g} vs {anchor[key]:.5g} of {variants[0]}"
            timed = harness.time_steps(make_step(model, opt, local), device, warmup=2,
                                       repeats=args.repeats if not args.tiny else 1,
                                       iters=args.iters if not args.tiny else 1)
            row = harness.make_row(WORK if not args.tiny else WORK + "-tiny", variant,
                                   "schedlang" if variant.startswith("schedlang") else "baseline", timed["ms"],
                                   args.rows * world * seq, flops, world if device.type == "cuda" else 0,
                                   harness.peak_memory_gib(device), verdict, ms_runs=timed["ms_runs"],
                                   first_loss=round(check["loss"], 6), first_grad_norm=round(check["grad_norm"], 6),
                                   first_expert_grad_norm=round(check["expert_grad_norm"], 8),
                                   layers=args.layers, experts=config.num_experts, top_k=config.num_experts_per_tok,
                                   rows_per_rank=args.rows, seq=seq)
            rows.append(row)
            if rank == 0:
                print(f"{variant:18s} {row['ms']:9.2f} ms  {row['tokens_per_s'] or 0:11.0f} tok/s  "
                      f"mfu {row['mfu'] if row['mfu'] is not None else '-'}  peak {row['peak_mem_gib']} GiB  "
                      f"check {verdict}", flush=True)
            del model, opt
        if rank == 0 and (args.out or not args.tiny):
            harness.write_results(f"moe-{world}gpu", rows, gpus=world if device.type == "cuda" else 0,
                                  directory=Path(args.out) if args.out else None,
                                  command=" ".join(["bench/bench_moe.py"] + list(argv if argv is not None
                                                                                 else sys.argv[1:])))
        return 0 if all(r["check"] == "ok" for r in rows) else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

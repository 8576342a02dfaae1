"""Tensor-parallel LLaMA training step: schedlang's schedule against PyTorch DTensor TP, side by side.

    torchrun --nproc_per_node=N bench/bench_tp.py [--variants a,b,...] [--iters 15] [--json out.json]

One process per GPU (NCCL). Every variant trains the same LLaMA-1.1B (22 layers, hidden 2048,
16 heads, intermediate 5632, vocab 32000), batch 4 x seq 2048, bf16 autocast, SDPA attention,
with the step of ``shared/bench/tp_baseline.py``: forward with ``labels=``, backward, optimizer
step, ``zero_grad``; 3 warm-up steps, then the mean of ``--iters`` steps between CUDA events.

Variants:

* ``dtensor-eager`` / ``dtensor-compile``: the reference: ``parallelize_module`` with
  Colwise/Rowwise q,k,v,o and gate,up,down; embeddings and LM head replicated; foreach AdamW;
  ``torch.compile(model)`` for the compiled one.
* ``schedlang-eager``: ``schedlang.models.llama.shard_llama`` (attention, MLP, vocabulary-
  parallel embedding and LM head, logits kept split, vocabulary-parallel loss), model created on
  the meta device and materialized per rank by ``schedlang.build``, fused AdamW; the forward is
  called with ``use_cache=False`` (no KV cache in a training step).
* ``schedlang-compile``: the same, every decoder layer's forward compiled
  (``schedlang.models.compile_layers``), the collectives running eagerly between compiled pieces;
  ``-compile-traced``: the collectives traced into the layer graphs; ``-compile-model``:
  ``torch.compile`` of the whole model.
* ``-sp``: with sequence parallelism; ``-norm``: ``shard_llama(grad_sync="norm")`` (each block's
  input gradient all-reduced at the norm output instead of by a keyword pre-hook on the block).

Correctness is checked in the same run: every variant starts from the same weights and batch as
the eager run of its family, so the rank's gradient norm after the first step and the loss after
the last one must agree with it (column ``check``).

``--tiny`` runs a 2-layer model on CPU ranks (gloo) to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

DEFAULT_VARIANTS = "dtensor-eager,dtensor-compile,schedlang-eager,schedlang-compile,schedlang-sp-compile"
PEAK_BF16 = 989e12  # dense bf16 per GPU (H100/H200 SXM), as in the reference scripts


def llama_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        layers = int(os.environ.get("TINY_LAYERS", 2))
        cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=256, intermediate_size=160, max_position_embeddings=64)
    else:
        cfg = LlamaConfig(num_hidden_layers=22, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                          vocab_size=32000, intermediate_size=5632, max_position_embeddings=2048)
    cfg._attn_implementation = "sdpa"
    return cfg


def make_dtensor(cfg, device, world, compile_model):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(device.type, (world,))
        plan = {}
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[f"{p}.{n}"] = ColwiseParallel()
            plan[f"{p}.self_attn.o_proj"] = RowwiseParallel()
            plan[f"{p}.mlp.down_proj"] = RowwiseParallel()
        parallelize_module(model, mesh, plan)
    from torch.distributed.tensor import DTensor

    dparams = [p for p in model.parameters() if isinstance(p, DTensor)]
    pparams = [p for p in model.parameters() if not isinstance(p, DTensor)]
    groups = [{"params": g} for g in (dparams, pparams) if g]
    opt = torch.optim.AdamW(groups, lr=1e-4, foreach=True)
    fwd = torch.compile(model) if compile_model else model
    return model, fwd, opt


def make_schedlang(cfg, device, sequence_parallel, compile_mode, grad_sync="block"):
    import schedlang
    from schedlang.models.llama import shard_llama
    from transformers import LlamaForCausalLM

    with schedlang.init_empty_weights():
        meta = LlamaForCausalLM(cfg)
    sch = schedlang.create_schedule(meta)
    shard_llama(sch, sequence_parallel=sequence_parallel, grad_sync=grad_sync)
    torch.manual_seed(0)
    fused = device.type == "cuda"
    model, opt = schedlang.build(sch, device=device, optimizer=torch.optim.AdamW, lr=1e-4,
                                 **({"fused": True} if fused else {"foreach": True}))
    fwd = model
    if compile_mode in ("layers", "layers-traced"):
        from schedlang.models import compile_layers

        compile_layers(model, trace_collectives=compile_mode == "layers-traced")
    elif compile_mode == "model":
        fwd = torch.compile(model)
    return model, fwd, opt


def parse_variant(name):
    """schedlang[-sp][-norm]-(eager | compile | compile-traced | compile-model), or dtensor-(eager | compile)."""
    parts = name.split("-")
    if parts[0] == "dtensor":
        if parts[1:] not in (["eager"], ["compile"]):
            raise ValueError(f"unknown variant {name!r}")
        return {"kind": "dtensor", "compile": parts[1] == "compile"}
    if parts[0] != "schedlang":
        raise ValueError(f"unknown variant {name!r}")
    rest = parts[1:]
    sp = "sp" in rest
    grad_sync = "norm" if "norm" in rest else "block"
    rest = [p for p in rest if p not in ("sp", "norm")]
    modes = {("eager",): None, ("compile",): "layers", ("compile", "traced"): "layers-traced",
             ("compile", "model"): "model"}
    if tuple(rest) not in modes:
        raise ValueError(f"unknown variant {name!r}")
    return {"kind": "schedlang", "sp": sp, "grad_sync": grad_sync, "compile_mode": modes[tuple(rest)]}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def run_variant(name, cfg, device, world, args):
    spec = parse_variant(name)
    if spec["kind"] == "dtensor":
        model, fwd, opt = make_dtensor(cfg, device, world, spec["compile"])
    else:
        model, fwd, opt = make_schedlang(cfg, device, spec["sp"], spec["compile_mode"], spec["grad_sync"])
    nparams_full = _full_param_count(cfg)
    batch, seq = args.batch, args.seq
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=gen)
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    # the reference step lets HF build a KV cache (config.use_cache); a training step needs none, and with
    # per-layer compilation its per-layer state would recompile every layer
    extra = {} if spec["kind"] == "dtensor" else {"use_cache": False}
    params = [p for p in model.parameters() if p.requires_grad]
    check = {}

    def step(record=False):
        with amp:
            out = fwd(input_ids=ids, labels=ids, **extra)
        out.loss.backward()
        if record:  # this rank's gradients after the first backward: the same layout in every schedlang variant
            check["grad_norm"] = float(torch.stack([_local(p.grad).float().pow(2).sum() for p in params]).sum().sqrt())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    losses = []
    for i in range(args.warmup):
        losses.append(float(step(record=i == 0).detach()))
    _sync(device)
    warm = time.time() - t0
    if world > 1:
        dist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            loss = step()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / args.iters
        mem = torch.cuda.max_memory_allocated() / 2 ** 30
    else:
        t = time.perf_counter()
        for _ in range(args.iters):
            loss = step()
        ms = (time.perf_counter() - t) * 1e3 / args.iters
        mem = 0.0
    tokens = batch * seq
    flops = 6 * nparams_full * tokens + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq * tokens
    mfu = flops / (ms / 1e3) / (PEAK_BF16 * world)
    result = {"variant": name, "ms": ms, "mfu": mfu, "warm_s": warm, "loss": float(loss.detach()), "mem_gib": mem,
              "tok_per_s": tokens / (ms / 1e3), "first_losses": losses, "grad_norm": check["grad_norm"]}
    del model, fwd, opt, loss, params
    return result


def correctness(results):
    """Each variant against the eager run of its family (same initial weights, same batch): the rank's
    gradient norm after the first step, and the loss after all steps (the batch is repeated, so a correct
    model memorizes it)."""
    ok = {r["variant"]: r for r in results if "error" not in r}
    out = {}
    for name, r in ok.items():
        ref = ok.get("dtensor-eager" if name.startswith("dtensor") else "schedlang-eager")
        if ref is None or ref is r:
            out[name] = "reference" if ref is r else "-"
            continue
        gn = abs(r["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
        final_ok = abs(r["loss"] - ref["loss"]) <= 0.1 + 0.25 * ref["loss"]
        out[name] = f"{'ok' if gn <= 0.05 and final_ok else 'MISMATCH'} (grad norm {gn * 100:.1f}%)"
    return out


def _full_param_count(cfg) -> int:
    h, i, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    kv = h // cfg.num_attention_heads * cfg.num_key_value_heads
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return n * per_layer + 2 * v * h + h


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _versions():
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name()
        out["cuda"] = torch.version.cuda
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true", help="2-layer model on CPU ranks (checks the script)")
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")
    args = parser.parse_args()
    if args.tiny:
        args.seq, args.batch = min(args.seq, 32), min(args.batch, 2)
    use_cuda = torch.cuda.is_available() and not args.tiny
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=600))
    cfg = llama_config(args.tiny)
    results = []
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        try:
            r = run_variant(name, cfg, device, world, args)
        except Exception as e:  # report and go on with the next variant
            r = {"variant": name, "error": f"{type(e).__name__}: {e}"}
            if rank == 0:
                traceback.print_exc()
        results.append(r)
        if rank == 0:
            if "error" in r:
                print(f"RESULT {name}: FAILED {r['error'][:300]}", flush=True)
            else:
                print(f"RESULT llama b{args.batch} s{args.seq} TP={world} [{name}] step={r['ms']:.1f} ms "
                      f"tok/s={r['tok_per_s']:,.0f} MFU/GPU={r['mfu'] * 100:.1f}% warm={r['warm_s']:.0f}s "
                      f"loss={r['loss']:.3f} mem={r['mem_gib']:.1f}GiB", flush=True)
        # each variant compiles from scratch: a cache entry of another variant's shapes would make dynamo
        # mark the sequence dimension dynamic
        torch._dynamo.reset()
        gc.collect()
        if use_cuda:
            torch.cuda.empty_cache()
        if world > 1:
            dist.barrier()
    if rank == 0:
        ok = {r["variant"]: r for r in results if "error" not in r}
        checks = correctness(results)
        print(f"\nTP={world}  {_versions()}")
        print(f"{'variant':34s} {'step ms':>8s} {'MFU/GPU':>8s} {'vs DT eager':>12s} {'vs DT compile':>14s}  "
              f"{'final loss':>10s}  check vs eager")
        for r in results:
            if "error" in r:
                print(f"{r['variant']:34s} {'failed':>8s}")
                continue
            ratios = [f"{ok[b]['ms'] / r['ms']:.2f}x" if b in ok else "-" for b in ("dtensor-eager", "dtensor-compile")]
            print(f"{r['variant']:34s} {r['ms']:8.1f} {r['mfu'] * 100:7.1f}% {ratios[0]:>12s} {ratios[1]:>14s}  "
                  f"{r['loss']:10.4f}  {checks[r['variant']]}")
        for r in results:
            r["check"] = checks.get(r["variant"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "versions": _versions(), "args": vars(args), "results": results,
                           "date": datetime.date.today().isoformat()}, f, indent=2)
    if world > 1:
        dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()

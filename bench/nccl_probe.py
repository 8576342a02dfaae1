"""How fast the machine's collectives are: bus bandwidth of NCCL all-reduce, all-gather and reduce-scatter.

    torchrun --nproc_per_node=2 bench/nccl_probe.py [--sizes-mb 32,128,1024] [--dtype bf16]

The multi-GPU figures depend on the interconnect as much as on the code: this measures it in the same
way for every size the training steps send (a decoder layer's gradient is ~100 MB in bf16, its
activations ~33 MB). Bus bandwidth is NCCL's convention: all-reduce moves 2(n-1)/n of the buffer per
rank, all-gather and reduce-scatter (n-1)/n of the whole. Each size: 5 warm-up calls, then the median of
20 timed calls between CUDA events. Prints a table on rank 0 and writes ``--json`` if given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _time(fn, warmup: int = 5, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", default="32,128,1024")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    dtype = DTYPES[args.dtype]
    rows = []
    for mb in (int(s) for s in args.sizes_mb.split(",")):
        numel = mb * 2**20 // torch.empty((), dtype=dtype).element_size() // world * world
        full = torch.randn(numel, device=device).to(dtype)
        part = torch.randn(numel // world, device=device).to(dtype)
        ops = {
            "all_reduce": (lambda: dist.all_reduce(full), 2 * (world - 1) / world),
            "all_gather": (lambda: dist.all_gather_into_tensor(full, part), (world - 1) / world),
            "reduce_scatter": (lambda: dist.reduce_scatter_tensor(part, full), (world - 1) / world),
        }
        for name, (fn, factor) in ops.items():
            ms = _time(fn)
            nbytes = full.numel() * full.element_size()
            rows.append({"op": name, "mb": mb, "dtype": args.dtype, "ms": round(ms, 4),
                         "bus_gb_s": round(nbytes * factor / (ms / 1e3) / 1e9, 1)})
    if rank == 0:
        print(f"{world} ranks, {torch.cuda.get_device_name()}, torch {torch.__version__}, nccl "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}")
        for r in rows:
            print(f"{r['op']:<15} {r['mb']:>6} MB {r['dtype']}  {r['ms']:>9.3f} ms  {r['bus_gb_s']:>7.1f} GB/s bus")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": world, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

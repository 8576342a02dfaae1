"""Launch shapes of the fused loss kernel: GPU time of one chunk's loss and gradient, per vocabulary.

    python bench/probe_loss_kernel.py [--results-dir DIR]     # on a GPU; bench/results by default
    python bench/probe_loss_kernel.py --tiny                  # the interpreter on the CPU: the script runs

``fused_linear_cross_entropy`` computes each chunk's logits with cuBLAS, then one Triton program per row
(``_cross_entropy_kernel``) streams the row twice, in blocks of ``BLOCK_V`` logits: a pass for its
maximum, sum of exponentials and target logit, a pass that writes the gradient over the logits in place.
Its launch shape (block width, warps) decides how fast it moves those bytes. This times the kernel alone
on a chunk of 4096 bf16 rows for vocabularies of 32000 (LLaMA-2), 50257 (GPT-2: a row of odd length is
not 16-byte aligned, so its loads cannot be vectorized) and 128256 (LLaMA-3), at a grid of launch shapes
and at the default that ``_launch_shape`` picks (``default``); then (``path: "sliced"``) the statistics and
gradient kernels that a vocabulary-parallel loss runs on each rank's slice, for slices of half of each
vocabulary (two ranks), with the same launch shapes. A width that is not a multiple of 16 runs twice: in
contiguous rows, and in the padded rows (``row_stride``) that the loss gives each chunk's logits.

``ms`` is :func:`harness.gpu_time_ms` (median GPU time, L2 flushed before each call); ``gb_per_s`` counts
6 bytes per logit (read twice, written once). Each shape's loss is checked against ``F.cross_entropy`` in
fp32 and its gradient against ``softmax - onehot`` (``check``: "ok" or "FAIL <largest error>"). A probe for
choosing the default, not a figure: the written file has no rows, so the README's tables never show it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # schedlang from this checkout, uninstalled
import harness  # noqa: E402  (bench/harness.py)

ROWS = 4096
VOCABS = (32000, 50257, 128256)
#: (BLOCK_V, num_warps, BLOCK_M) tried on the GPU
SHAPES: Tuple[Tuple[int, int, int], ...] = ((8192, 16, 1), (8192, 8, 1), (4096, 16, 1), (4096, 8, 1), (4096, 4, 1),
                                            (2048, 8, 1), (2048, 4, 1), (1024, 4, 1), (4096, 8, 2), (2048, 8, 2))
TINY_ROWS, TINY_VOCABS = 6, (100, 257)
#: loss and gradient tolerances of a bf16 chunk against fp32 (the gradient is stored in bf16)
TOL = {"loss": 1e-4, "grad": 4e-3}


def _module():
    """The kernels' module (the package re-exports its function under the same name)."""
    return importlib.import_module("schedlang.kernels.fused_linear_cross_entropy")


def _chunk(rows: int, vocab: int, device: torch.device, padded: bool = False):
    """A chunk of bf16 logits and its targets; ``padded``: in rows padded as ``_logits`` lays them out."""
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(rows, vocab, device=device, generator=g) * 3).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device=device, generator=g)
    target[::4] = -100  # ignored rows, as padding is
    if padded:
        buffer = torch.zeros((rows, _module().padded_width(vocab)), dtype=logits.dtype, device=device)
        buffer[:, :vocab] = logits
        logits = buffer[:, :vocab]
    return logits, target


def _expected(logits: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    z = logits.float()
    loss = F.cross_entropy(z, target, reduction="none", ignore_index=-100)
    valid = (target != -100)[:, None]
    grad = (torch.softmax(z, -1) - F.one_hot(target.clamp(min=0), z.shape[1])) * valid
    return loss, grad


def _launcher(module, path: str, z: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, lse: torch.Tensor,
              shape: dict):
    """A call of the kernels of one path over the chunk ``z``: ``"whole"``, the loss kernel of a whole vocabulary;
    ``"sliced"``, the statistics kernel then the gradient kernel, as a vocabulary slice (tensor parallelism) or a
    per-token loss runs them, here over a slice that is the whole vocabulary (the statistics are combined into
    ``lse`` and ``loss`` between them, as the group's all-reduces do)."""
    import triton

    from schedlang.kernels.row_kernels import triton_dtype

    rows, vocab = z.shape
    grid = (triton.cdiv(rows, shape["BLOCK_M"]),)
    dtype = triton_dtype(z.dtype)
    if path == "whole":
        return lambda: module._cross_entropy_kernel[grid](z, z.stride(0), target, loss, lse, rows, vocab, -100,
                                                          WRITE_GRAD=True, DTYPE=dtype, **shape)
    stats = torch.empty((3, rows), dtype=torch.float32, device=z.device)

    def call():
        module._statistics_kernel[grid](z, z.stride(0), target, stats, rows, vocab, 0, -100, **shape)
        lse.copy_(stats[0] + torch.log(stats[1]))
        loss.copy_(torch.where(target != -100, lse - stats[2], torch.zeros_like(lse)))
        module._gradient_kernel[grid](z, z.stride(0), target, lse, lse, rows, vocab, 0, -100, HAS_SCALE=False,
                                      DTYPE=dtype, **shape)

    return call


def measure(rows: int, vocab: int, shapes: Sequence[Tuple[int, int, int]], device: torch.device,
            path: str = "whole", padded: bool = False) -> List[dict]:
    """One row per launch shape (and the default) for a chunk of ``rows`` x ``vocab`` bf16 logits, through the
    kernels of ``path`` (see :func:`_launcher`), in contiguous rows or (``padded``) in the padded rows the loss
    gives a chunk's logits."""
    module = _module()
    logits, target = _chunk(rows, vocab, device, padded)
    want_loss, want_grad = _expected(logits, target)
    aligned = module.rows_aligned(logits)
    default = module._launch_shape(vocab, aligned_rows=aligned)
    launches: Dict[str, dict] = {"default": default}
    for block_v, warps, block_m in shapes:
        launches[f"v{block_v}-w{warps}-m{block_m}"] = {"BLOCK_M": block_m, "BLOCK_V": block_v, "num_warps": warps}
    out = []
    for name, shape in launches.items():
        z = logits.clone() if not padded else _chunk(rows, vocab, device, padded)[0]  # clone() would unpad
        loss = torch.empty(rows, device=device)
        lse = torch.empty(rows, device=device)
        call = _launcher(module, path, z, target, loss, lse, shape)
        call()  # z holds the gradient of the logits now; later calls redo the same work on it
        loss_err = (loss - want_loss).abs().max().item()
        grad_err = (z.float() - want_grad).abs().max().item()
        ok = loss_err <= TOL["loss"] * max(1.0, want_loss.abs().max().item()) and grad_err <= TOL["grad"]
        ms = harness.call_time_ms(call, device)
        row = {"path": path, "vocab": vocab, "rows": rows, "launch": name, "shape": dict(shape), "rows_aligned": aligned,
               "row_stride": logits.stride(0),
               "ms": round(ms, 4), "gb_per_s": round(6 * rows * vocab / ms / 1e6, 1),
               "check": "ok" if ok else f"FAIL loss error {loss_err:.3g}, gradient error {grad_err:.3g}"}
        out.append(row)
        print(row, flush=True)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", default=None, help="where the JSON goes (default: bench/results)")
    parser.add_argument("--tiny", action="store_true", help="small chunks in the interpreter on the CPU")
    args = parser.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, rows, vocabs, shapes = torch.device("cpu"), TINY_ROWS, TINY_VOCABS, ((128, 4, 1), (64, 4, 2))
    else:
        device, rows, vocabs, shapes = torch.device("cuda"), ROWS, VOCABS, SHAPES
    module = _module()
    # every width in contiguous rows, and again in padded rows where padding changes the row stride
    results = [r for path, widths in (("whole", vocabs), ("sliced", [v // 2 for v in vocabs]))
               for vocab in widths
               for padded in ((False, True) if module.padded_width(vocab) != vocab else (False,))
               for r in measure(rows, vocab, shapes, device, path=path, padded=padded)]
    probe = {"kernels": {"whole": "schedlang.kernels.fused_linear_cross_entropy._cross_entropy_kernel",
                         "sliced": "_statistics_kernel, then _gradient_kernel"}, "results": results}
    harness.write_probe("probe-loss-kernel", probe, gpus=0 if args.tiny else 1, results_dir=args.results_dir)
    return probe


if __name__ == "__main__":
    main()

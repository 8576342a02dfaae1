"""How far the gradient-direction check of ``bench_train.py`` sits from right and from wrong training steps.

    python bench/probe_grad_direction.py               # LLaMA-1.1B on a GPU (bf16 autocast; float8 with torchao)
    python bench/probe_grad_direction.py --tiny        # the 2-layer model in fp32 on the CPU

``bench_train.py`` passes a variant whose first gradient has a cosine with the eager model's of at least
``harness.TOL_BF16["grad_cosine"]`` (``TOL_FP32`` in fp32, ``harness.GRAD_COSINE_FLOAT8`` for the float8 works),
measured on random projections per parameter (``harness.grad_fingerprint``). This probe computes that cosine
for the same model and batch when the step is right and when it is wrong in ways the loss value alone does not
show at a random initialization (the loss is about ln(vocab) whatever the labels):

* ``eager``: the eager step again (the floor of the noise: 1.0 unless the GPU's kernels are not deterministic);
* ``unshifted``: every token its own label (the labels not shifted);
* ``shifted-by-2``: the labels shifted one position too far;
* ``permuted-rows``: each sequence trained on another sequence's labels;
* ``float8`` and ``float8-unshifted`` (with torchao and float8 tensor cores): torchao's float8 Linears in the
  blocks, as ``titan-style-fp8`` converts them, with right and with unshifted labels.

Each wrong step must fall well below its bound, each right one well above. The result goes to
``bench/results/<date>-grad-direction.json``, under the key ``probe`` (``--results-dir`` to change where).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Dict

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # schedlang from this checkout, uninstalled
import baselines as B  # noqa: E402  (bench/baselines.py)
import harness  # noqa: E402  (bench/harness.py)


def _wrong_labels(ids: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:
    shifted_by_2 = torch.roll(ids, -2, dims=1)
    shifted_by_2[:, -2:] = -100
    return {"unshifted": ids, "shifted-by-2": shifted_by_2, "permuted-rows": torch.roll(labels, 1, dims=0)}


def fingerprint_of(cfg, device, ids, labels, bf16: bool, prepare: Callable = None) -> Dict[str, list]:
    """The first gradient's fingerprint of the freshly initialized model on (ids, labels), eager."""
    model = B.full_model(cfg, device)
    if prepare is not None:
        prepare(model)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    with autocast:
        logits = model(input_ids=ids, use_cache=False).logits
        loss = B.plain_loss(logits, labels)
    del logits
    loss.backward()
    fingerprint = harness.grad_fingerprint(model.named_parameters())
    del model, loss
    harness.free_memory(device)
    return fingerprint


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the 2-layer model in fp32 on the CPU")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--results-dir", default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    seq = min(args.seq, 32) if args.tiny else args.seq
    batch = min(args.batch, 2) if args.tiny else args.batch
    cfg = B.model_config("llama", "llama-1.1b", args.tiny, seq=seq)
    ids, labels = harness.global_batch(cfg.vocab_size, batch, seq, device)

    def cosine(fingerprint, reference):
        return round(harness.fingerprint_cosine(fingerprint, reference)[0], 6)

    reference = fingerprint_of(cfg, device, ids, labels, cuda)
    cases = {"eager": cosine(fingerprint_of(cfg, device, ids, labels, cuda), reference)}
    for name, wrong in _wrong_labels(ids, labels).items():
        cases[name] = cosine(fingerprint_of(cfg, device, ids, wrong, cuda), reference)
    float8 = None
    if cuda and torch.cuda.get_device_capability() >= (8, 9):
        def to_float8(model):
            B.convert_blocks_to_float8(model, "tensorwise")

        try:
            cases["float8"] = cosine(fingerprint_of(cfg, device, ids, labels, cuda, to_float8), reference)
            cases["float8-unshifted"] = cosine(fingerprint_of(cfg, device, ids, ids, cuda, to_float8), reference)
            float8 = "torchao tensorwise"
        except B.NotAvailable as e:
            float8 = f"not run: {e}"
    bounds = {"bf16": harness.TOL_BF16["grad_cosine"], "fp32": harness.TOL_FP32["grad_cosine"],
              "float8": harness.GRAD_COSINE_FLOAT8}
    row = {"work": "llama-1.1b-1gpu" if not args.tiny else "llama-tiny", "batch": batch, "seq": seq,
           "dtype": "bf16 autocast / fp32 weights" if cuda else "fp32", "float8": float8,
           "cosine_with_eager": cases, "bounds": bounds}
    for name, value in cases.items():
        print(f"{name:18s} cosine {value:.6f}")
    harness.write_probe("grad-direction", row, gpus=1 if cuda else 0, results_dir=args.results_dir)
    return row


if __name__ == "__main__":
    main()

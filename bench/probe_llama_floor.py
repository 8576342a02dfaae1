"""The floor of a LLaMA-1.1B training step on one GPU: the work a bf16 step cannot drop, timed as steps.

    python bench/probe_llama_floor.py [--rounds 2] [--results-dir DIR]   # on a GPU; bench/results by default

At the shapes of ``bench_train.py --work llama-1.1b-1gpu`` (4 x 2048 tokens, hidden 2048, 16 heads of 128,
MLP 5632, vocabulary 32000, 22 layers, bf16), three synthetic steps, each timed as the training steps are
(``harness.time_steps``: CUDA events, and the GPU's clock, power and energy per step):

* ``gemms+attention``: every GEMM of the step forward and backward (input and weight gradients), each
  layer's causal cuDNN attention forward and backward, and the LM head's GEMMs over the full logits, back to
  back: the compute every bf16 implementation of the step does, and nothing else;
* ``+adamw``: then torch's fused AdamW over the model's 1.26B fp32 parameters, as both steps of the work
  update them;
* ``+min-traffic``: and, between the GEMMs where that work runs, copies that move the fewest bytes the
  memory-bound work needs (norms, rotary embedding, SwiGLU and residual adds, each fused into one pass
  forward and one backward; the embedding and the loss), counted by :func:`min_traffic_bytes`.

The last is the step of an implementation with perfect fusion around cuBLAS's GEMMs. Under a GPU's power
limit a step's time follows its energy, so this floor is measured rather than added up from parts timed
alone. A probe for deciding what is reachable, not a figure: the training step is measured by
``bench_train.py``, against its baselines in the same process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/harness.py)

BATCH, SEQ, HIDDEN, HEADS, INTERMEDIATE, VOCAB, LAYERS = 4, 2048, 2048, 16, 5632, 32000, 22
TOKENS = BATCH * SEQ
BF16 = torch.bfloat16
#: (output, input) features of each decoder layer's linears, in the order the forward runs them
LAYER_LINEARS = [("q", HIDDEN, HIDDEN), ("k", HIDDEN, HIDDEN), ("v", HIDDEN, HIDDEN), ("o", HIDDEN, HIDDEN),
                 ("gate", INTERMEDIATE, HIDDEN), ("up", INTERMEDIATE, HIDDEN), ("down", HIDDEN, INTERMEDIATE)]


def n_params() -> int:
    """Parameters of the work's model: 22 layers of 7 linears and 2 norms, the embedding, the final norm and
    an untied LM head."""
    layer = sum(out * inp for _, out, inp in LAYER_LINEARS) + 2 * HIDDEN
    return LAYERS * layer + 2 * VOCAB * HIDDEN + HIDDEN


def step_flops() -> Dict[str, float]:
    """FLOPs of the GEMMs and the attention of one step, and their total: 2 per multiply-add, forward once and
    backward twice (input and weight gradients). Causal attention does half of its square, and its backward
    recomputes the scores, as cuDNN's and Flash's kernels do. (The harness's model FLOPs count the full square
    without the recompute, and the embedding as if it were a GEMM.)"""
    linears = LAYERS * sum(out * inp for _, out, inp in LAYER_LINEARS) + VOCAB * HIDDEN
    gemm = 3 * 2.0 * TOKENS * linears
    product = 2.0 * BATCH * HEADS * SEQ * SEQ * (HIDDEN // HEADS) / 2  # one causal S x S x head_dim product
    attention = LAYERS * (2 + 5) * product  # forward: scores, weighted sum; backward: 5 products
    return {"gemm": gemm, "attention": attention, "total": gemm + attention}


def min_traffic_bytes() -> Dict[str, int]:
    """The fewest HBM bytes the memory-bound work of one decoder layer moves in bf16, forward and backward, if
    every piece of it is one pass (read its inputs once, write its outputs once), and that of the embedding
    and the loss. Activations of ``TOKENS x HIDDEN`` are ``a`` bytes, of ``TOKENS x INTERMEDIATE`` ``m``."""
    a, m = TOKENS * HIDDEN * 2, TOKENS * INTERMEDIATE * 2
    forward = (
        4 * a      # residual add + input norm: read the stream and the last layer's output, write both
        + 4 * a    # rotary embedding of q and k: read them, write them
        + 4 * a    # residual add + post-attention norm
        + 3 * m)   # SwiGLU: read gate and up, write their product
    backward = (
        5 * m      # SwiGLU: read gate, up and the product's gradient, write both gradients
        + 2 * 4 * a  # two norms: read the saved input, the gradient and the residual's gradient, write one
        + 4 * a)   # rotary: read the q and k gradients, write them
    logits = TOKENS * VOCAB * 2
    ends = (
        2 * a + 2 * a        # embedding forward (gather, write) and backward (read the gradient, scatter)
        + VOCAB * HIDDEN * 2  # the embedding's gradient, zeroed
        + 4 * logits)        # the loss over chunks of logits: write, read, write the gradient, read it
    return {"layer_forward": forward, "layer_backward": backward, "ends": ends,
            "step": LAYERS * (forward + backward) + ends}


class SyntheticStep:
    """The buffers of the synthetic steps: one weight per linear per layer (so every layer reads its own), a few
    activation buffers the layers reuse (their values do not change the kernels' work)."""

    def __init__(self, device: torch.device):
        g = torch.Generator(device=device).manual_seed(0)

        def randn(*shape, scale=1.0, dtype=BF16):
            return torch.randn(*shape, device=device, dtype=dtype, generator=g) * scale

        self.weights = [{name: randn(out, inp, scale=0.02) for name, out, inp in LAYER_LINEARS}
                        for _ in range(LAYERS)]
        self.head = randn(VOCAB, HIDDEN, scale=0.02)
        self.x = randn(TOKENS, HIDDEN)
        self.mlp = randn(TOKENS, INTERMEDIATE)
        self.grad_hidden = randn(TOKENS, HIDDEN)
        self.grad_mlp = randn(TOKENS, INTERMEDIATE)
        self.grad_logits = randn(TOKENS, VOCAB, scale=1e-4)
        shape = (BATCH, HEADS, SEQ, HIDDEN // HEADS)
        self.qkv = [randn(*shape).requires_grad_() for _ in range(3)]
        self.grad_attention = randn(*shape)
        self.traffic = min_traffic_bytes()
        largest = max(self.traffic["layer_forward"], self.traffic["layer_backward"], self.traffic["ends"])
        # a copy moves twice its size: read the source, write the destination
        self.copy_src = torch.empty(largest // 2, device=device, dtype=torch.uint8)
        self.copy_dst = torch.empty_like(self.copy_src)
        self.optimizer = None

    def add_optimizer(self) -> None:
        count = n_params()
        flat = torch.randn(count, device=self.x.device) * 0.02
        param = torch.nn.Parameter(flat)
        param.grad = torch.randn_like(flat) * 1e-3
        self.optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)
        self.optimizer.step()  # its state exists before timing

    def move(self, n_bytes: int) -> None:
        half = n_bytes // 2
        self.copy_dst[:half].copy_(self.copy_src[:half])

    def step(self, traffic: bool) -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        x, mlp = self.x, self.mlp
        attention: List[torch.Tensor] = []  # each layer's output, kept with what its backward saved
        for w in self.weights:  # forward; the GEMMs' values are not used, only their work counts
            for name, _, _ in LAYER_LINEARS:
                torch.mm(mlp if name == "down" else x, w[name].t())
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                attention.append(F.scaled_dot_product_attention(*self.qkv, is_causal=True))
            if traffic:
                self.move(self.traffic["layer_forward"])
        torch.mm(x, self.head.t())
        torch.mm(self.grad_logits, self.head)  # LM head: input gradient
        torch.mm(self.grad_logits.t(), x)  # and weight gradient
        if traffic:
            self.move(self.traffic["ends"])
        for w in reversed(self.weights):  # backward
            for name, _, _ in reversed(LAYER_LINEARS):
                grad_out = self.grad_hidden if name in ("q", "k", "v", "o", "down") else self.grad_mlp
                torch.mm(grad_out, w[name])  # input gradient
                torch.mm(grad_out.t(), mlp if name == "down" else x)  # weight gradient
            torch.autograd.grad(attention.pop(), self.qkv, self.grad_attention)
            if traffic:
                self.move(self.traffic["layer_backward"])
        if self.optimizer is not None:
            self.optimizer.step()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="the three steps timed in turn this many times")
    parser.add_argument("--results-dir", default=None, help="where the JSON goes (default: bench/results)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    synthetic = SyntheticStep(device)
    flops = step_flops()
    variants: Dict[str, Callable[[], None]] = {
        "gemms+attention": lambda: synthetic.step(traffic=False),
        "+adamw": lambda: synthetic.step(traffic=False),
        "+min-traffic": lambda: synthetic.step(traffic=True),
    }
    rows: List[dict] = []
    for round_ in range(args.rounds):
        synthetic.optimizer = None
        for name, fn in variants.items():
            if name == "+adamw" and synthetic.optimizer is None:
                synthetic.add_optimizer()
            timed = harness.time_steps(fn, device)
            row = {"variant": name, "round": round_, "ms": round(timed["ms"], 2), "ms_runs": timed["ms_runs"],
                   "tflops": round(flops["total"] / (timed["ms"] / 1e3) / 1e12, 1), "gpu_clock": timed["gpu_clock"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
        synthetic.optimizer = None
        harness.free_memory(device)
    probe = {"work": "llama-1.1b-1gpu", "step_flops": flops, "params": n_params(),
             "min_traffic_bytes": min_traffic_bytes(), "steps": rows}
    # no rows, so that the README's tables never take the probe for a timing of the work
    path = harness.write_results("probe-llama-floor", [], gpus=1, merge=False,
                                 directory=Path(args.results_dir) if args.results_dir else None, probe=probe)
    print(f"wrote {path}")
    return probe


if __name__ == "__main__":
    main()

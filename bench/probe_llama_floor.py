"""The floor of a LLaMA-1.1B training step on one GPU: the work a bf16 step cannot drop, timed as steps.

    python bench/probe_llama_floor.py [--rounds 2] [--results-dir DIR]   # on a GPU; bench/results by default
    python bench/probe_llama_floor.py --tiny --rounds 1                  # 2 small layers on the CPU: the script runs

At the shapes of ``bench_train.py --work llama-1.1b-1gpu`` (4 x 2048 tokens, hidden 2048, 16 heads of 128,
MLP 5632, vocabulary 32000, 22 layers, bf16), four synthetic steps, each timed as the training steps are
(``harness.time_steps``: CUDA events, and the GPU's clock, power and energy per step):

* ``gemms+attention``: every GEMM of the step forward and backward (input and weight gradients), each
  layer's causal cuDNN attention forward and backward, and the LM head's GEMMs over the full logits, back to
  back: the compute of a bf16 step on cuBLAS and cuDNN, and nothing else;
* ``+adamw``: then torch's fused AdamW over the model's 1.26B fp32 parameters (in the work's profiles the
  steps' FusedAdamW kernel takes as long);
* ``+min-traffic``: and, between the GEMMs where that work runs, copies that move the fewest bytes the
  memory-bound work needs (norms, rotary embedding, SwiGLU and residual adds, each fused into one pass
  forward and one backward; the embedding and the loss), counted by :func:`min_traffic_bytes`, with every
  activation in bf16;
* ``+min-traffic-fp32-stream``: the same with the residual stream, its gradient and the embedding in fp32
  (each norm's backward also writing the bf16 copy of the residual gradient that the next GEMMs read). That
  is the numerics of the work's steps: the titan-style step keeps fp32 weights under bf16 autocast, so its
  embedding and residual adds stay fp32, and schedlang's steps keep them fp32 too, to train like it.

The last two are the step of an implementation with perfect fusion around cuBLAS's GEMMs, in bf16
activations and in the work's own numerics (the floor its steps are held to). Under a GPU's power
limit a step's time follows its energy, so this floor is measured rather than added up from parts timed
alone. A probe for deciding what is reachable, not a figure: the training step is measured by
``bench_train.py``, against its baselines in the same process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/harness.py)

BF16 = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    """The model and batch of a synthetic step; the default is the work's."""

    batch: int = 4
    seq: int = 2048
    hidden: int = 2048
    heads: int = 16  # key/value heads as many
    intermediate: int = 5632
    vocab: int = 32000
    layers: int = 22

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def linears(self) -> List[Tuple[str, int, int]]:
        """(name, output, input features) of each decoder layer's linears, in the order the forward runs them."""
        h, i = self.hidden, self.intermediate
        return [("q", h, h), ("k", h, h), ("v", h, h), ("o", h, h), ("gate", i, h), ("up", i, h), ("down", h, i)]


WORK = Shape()
#: a 2-layer shape that runs on the CPU in seconds: checks the script, measures nothing
TINY = Shape(batch=2, seq=16, hidden=32, heads=2, intermediate=48, vocab=64, layers=2)


def n_params(shape: Shape = WORK) -> int:
    """Parameters of the model: per layer 7 linears and 2 norms, the embedding, the final norm and an untied
    LM head."""
    layer = sum(out * inp for _, out, inp in shape.linears()) + 2 * shape.hidden
    return shape.layers * layer + 2 * shape.vocab * shape.hidden + shape.hidden


def step_flops(shape: Shape = WORK) -> Dict[str, float]:
    """FLOPs of the GEMMs and the attention of one step, and their total: 2 per multiply-add, forward once and
    backward twice (input and weight gradients). Causal attention does half of its square, and its backward
    recomputes the scores, as cuDNN's and Flash's kernels do. (The harness's model FLOPs count the full square
    without the recompute, and the embedding as if it were a GEMM.)"""
    linears = shape.layers * sum(out * inp for _, out, inp in shape.linears()) + shape.vocab * shape.hidden
    gemm = 3 * 2.0 * shape.tokens * linears
    # one causal S x S x head_dim product over every head: half of 2 * batch * seq^2 * hidden
    product = 2.0 * shape.batch * shape.seq * shape.seq * shape.hidden / 2
    attention = shape.layers * (2 + 5) * product  # forward: scores, weighted sum; backward: 5 products
    return {"gemm": gemm, "attention": attention, "total": gemm + attention}


def min_traffic_bytes(shape: Shape = WORK, stream_bytes: int = 2) -> Dict[str, int]:
    """The fewest HBM bytes the memory-bound work of one decoder layer moves, forward and backward, if every
    piece of it is one pass (read its inputs once, write its outputs once), and that of the embedding and the
    loss. Activations of ``tokens x hidden`` are ``a`` bytes in bf16, of ``tokens x intermediate`` ``m``; the
    residual stream, its gradient and the embedding take ``stream_bytes`` per value (2: bf16, 4: fp32), ``s``
    bytes a tensor. With an fp32 stream, each norm's backward also writes the bf16 copy of the residual
    gradient that the GEMMs before it read (a bf16 stream is that copy itself)."""
    if stream_bytes not in (2, 4):
        raise ValueError(f"stream_bytes={stream_bytes!r}: the residual stream is bf16 (2) or fp32 (4)")
    a, m = shape.tokens * shape.hidden * 2, shape.tokens * shape.intermediate * 2
    s = a * stream_bytes // 2
    grad_copy = a if stream_bytes > 2 else 0
    forward = (
        2 * s + 2 * a  # residual add + input norm: read the stream and the last layer's output, write the
                       # stream and the normalized input
        + 4 * a        # rotary embedding of q and k: read them, write them
        + 2 * s + 2 * a  # residual add + post-attention norm
        + 3 * m)       # SwiGLU: read gate and up, write their product
    backward = (
        5 * m          # SwiGLU: read gate, up and the product's gradient, write both gradients
        + 2 * (3 * s + a + grad_copy)  # two norms: read the saved stream, the gradient and the residual's
                                       # gradient, write the residual's gradient (and its bf16 copy)
        + 4 * a)       # rotary: read the q and k gradients, write them
    logits = shape.tokens * shape.vocab * 2
    ends = (
        2 * s + 2 * s        # embedding forward (gather, write) and backward (read the gradient, scatter)
        + shape.vocab * shape.hidden * stream_bytes  # the embedding's gradient, zeroed
        + 4 * logits)        # the loss over chunks of logits: write, read, write the gradient, read it
    return {"layer_forward": forward, "layer_backward": backward, "ends": ends,
            "step": shape.layers * (forward + backward) + ends}


class SyntheticStep:
    """The buffers of the synthetic steps: one weight per linear per layer (so every layer reads its own), a few
    activation buffers the layers reuse (their values do not change the kernels' work)."""

    def __init__(self, device: torch.device, shape: Shape = WORK):
        self.shape = shape
        g = torch.Generator(device=device).manual_seed(0)

        def randn(*size, scale=1.0, dtype=BF16):
            return torch.randn(*size, device=device, dtype=dtype, generator=g) * scale

        t, h, i = shape.tokens, shape.hidden, shape.intermediate
        self.weights = [{name: randn(out, inp, scale=0.02) for name, out, inp in shape.linears()}
                        for _ in range(shape.layers)]
        self.head = randn(shape.vocab, h, scale=0.02)
        self.x, self.mlp = randn(t, h), randn(t, i)
        self.grad_hidden, self.grad_mlp = randn(t, h), randn(t, i)
        self.grad_logits = randn(t, shape.vocab, scale=1e-4)
        heads = (shape.batch, shape.heads, shape.seq, h // shape.heads)
        self.qkv = [randn(*heads).requires_grad_() for _ in range(3)]
        self.grad_attention = randn(*heads)
        # cuDNN's attention on the GPU, as the work's steps run it; the math kernel elsewhere
        from torch.nn.attention import SDPBackend

        self.attention_backend = SDPBackend.CUDNN_ATTENTION if device.type == "cuda" else SDPBackend.MATH
        #: the fewest bytes with a bf16 and with an fp32 residual stream, by ``stream_bytes``
        self.traffic = {n: min_traffic_bytes(shape, stream_bytes=n) for n in (2, 4)}
        largest = max(t[part] for t in self.traffic.values() for part in ("layer_forward", "layer_backward", "ends"))
        # a copy moves twice its size: read the source, write the destination
        self.copy_src = torch.empty(largest // 2, device=device, dtype=torch.uint8)
        self.copy_dst = torch.empty_like(self.copy_src)
        self.optimizer = None

    def add_optimizer(self) -> None:
        flat = torch.randn(n_params(self.shape), device=self.x.device) * 0.02
        param = torch.nn.Parameter(flat)
        param.grad = torch.randn_like(flat) * 1e-3
        self.optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)
        self.optimizer.step()  # its state exists before timing

    def move(self, n_bytes: int) -> None:
        half = n_bytes // 2
        self.copy_dst[:half].copy_(self.copy_src[:half])

    def step(self, stream_bytes: Optional[int] = None) -> None:
        """One synthetic step; with ``stream_bytes`` (2 or 4) also the copies of :func:`min_traffic_bytes`."""
        from torch.nn.attention import sdpa_kernel

        traffic = self.traffic[stream_bytes] if stream_bytes else None

        x, mlp, linears = self.x, self.mlp, self.shape.linears()
        attention: List[torch.Tensor] = []  # each layer's output, kept with what its backward saved
        for w in self.weights:  # forward; the GEMMs' values are not used, only their work counts
            for name, _, _ in linears:
                torch.mm(mlp if name == "down" else x, w[name].t())
            with sdpa_kernel(self.attention_backend):
                attention.append(F.scaled_dot_product_attention(*self.qkv, is_causal=True))
            if traffic:
                self.move(traffic["layer_forward"])
        torch.mm(x, self.head.t())
        torch.mm(self.grad_logits, self.head)  # LM head: input gradient
        torch.mm(self.grad_logits.t(), x)  # and weight gradient
        if traffic:
            self.move(traffic["ends"])
        for w in reversed(self.weights):  # backward
            for name, _, _ in reversed(linears):
                grad_out = self.grad_hidden if name in ("q", "k", "v", "o", "down") else self.grad_mlp
                torch.mm(grad_out, w[name])  # input gradient
                torch.mm(grad_out.t(), mlp if name == "down" else x)  # weight gradient
            torch.autograd.grad(attention.pop(), self.qkv, self.grad_attention)
            if traffic:
                self.move(traffic["layer_backward"])
        if self.optimizer is not None:
            self.optimizer.step()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="the four steps timed in turn this many times")
    parser.add_argument("--results-dir", default=None, help="where the JSON goes (default: bench/results)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer shape on the CPU: checks the script")
    args = parser.parse_args(argv)
    device, shape = (torch.device("cpu"), TINY) if args.tiny else (torch.device("cuda"), WORK)
    synthetic = SyntheticStep(device, shape)
    flops = step_flops(shape)
    variants: Dict[str, Callable[[], None]] = {
        "gemms+attention": lambda: synthetic.step(),
        "+adamw": lambda: synthetic.step(),
        "+min-traffic": lambda: synthetic.step(stream_bytes=2),
        "+min-traffic-fp32-stream": lambda: synthetic.step(stream_bytes=4),
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
    probe = {"work": "tiny" if args.tiny else "llama-1.1b-1gpu", "shape": dataclasses.asdict(shape),
             "step_flops": flops, "params": n_params(shape), "min_traffic_bytes": synthetic.traffic[2],
             "min_traffic_bytes_fp32_stream": synthetic.traffic[4],
             "steps": rows}
    harness.write_probe("probe-llama-floor", probe, gpus=0 if args.tiny else 1, results_dir=args.results_dir)
    return probe


if __name__ == "__main__":
    main()

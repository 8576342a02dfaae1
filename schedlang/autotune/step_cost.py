"""The cost of one training step of a decoder-only transformer under a layout, before anything runs.

:func:`estimate_step` gives, per rank, the memory of the parameters (fp32 master weights), the gradients, the
optimizer's state, FSDP2's gathered weights and the activations, the collectives of a step with their bytes and
the link each one crosses (:mod:`schedlang.autotune.cluster`), and the step time: the model's flops at a fraction
of the devices' peak, plus what the communication adds where it cannot hide behind compute, the pipeline's bubble
and the memory-bound optimizer step.

Activations are counted tensor by tensor for a pre-norm decoder (attention and a gated or plain MLP), which is
what HF's causal LMs are. Activation checkpointing has two modes:

* ``full``: each layer keeps only its input; the backward recomputes the layer's forward.
* ``selective``: the op-level policy torchtitan calls selective ("op"): inside each layer every other matmul's
  output is saved (in call order: q, v, the MLP's gate and its down projection; in a plain MLP its first
  projection), with attention's output and its log-sum-exp; the other matmuls (k, o, up) and the elementwise ops
  (norms, rotary embeddings, the activation function) are recomputed.

The memory is the step's tensor peak (what ``torch.cuda.max_memory_allocated`` reports), the larger of two
moments. Early in the backward: every layer's saved activations, with the larger of the loss's backward (the
logits and its fp32 tensors) and the first layer's backward after it (what a checkpointed layer recomputes, and
what a layer's backward allocates at its MLP and at its norm, and FSDP2's unsharded gradients), and the
gradients only where they outlive a microbatch (accumulation, a pipeline, where a rank that runs every forward
first has them whole once its first backward freed a microbatch). At the end of the backward: every gradient and a layer's backward. The caching allocator's reserve
over the tensors is not counted; :data:`USABLE_MEMORY` leaves room for it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

from .cluster import NVLINK
from .hardware import FLOAT8_DEVICES, GIB, Hardware
from .moe_cost import LOAD_IMBALANCE, MoEShape, all_to_all_bytes, mean_mlp_width

#: fraction of the peak a step reaches: compiled layers with optimize_model, compiled, eager (bench/bench_train.py)
_EFFICIENCY = {"optimize": 0.48, "compile": 0.42, "eager": 0.33}
#: the share of overlapped communication that still costs time (its kernels take SMs and memory bandwidth)
_CONTENTION = 0.1
#: bytes a CUDA rank holds besides the tensors counted here (cuBLAS workspace, allocator slack)
_CUDA_ALLOWANCE = 0.5 * GIB
#: the share of a GPU's peak that a forward bf16 GEMM of a layer's size reaches (H100: ~0.7 at hidden 2048 and up)
_FORWARD_GEMM_EFFICIENCY = 0.7
#: the part of a device's memory a layout may plan to use: the rest is for the caching allocator's reserve over
#: the tensors the estimate counts (2.0 to 8.2 GiB on the trainer's 1-GPU runs of an 80 GiB H100,
#: bench/results/2026-12-06-planner-validation-reserve-h100.json)
USABLE_MEMORY = 0.9
#: fp32 copies of its input an eager RMSNorm's backward holds at once (traced: the upcast gradient, the power's,
#: the mean's and the products' gradients)
_EAGER_NORM_BACKWARD_COPIES = 6
CHECKPOINT_MODES = ("none", "selective", "full")
DP_MODES = ("fsdp", "hsdp", "ddp")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer. ``params`` counts tied weights once; ``flops_params`` leaves out
    the embedding lookups and, in a mixture of experts, counts only the routed experts a token uses (``top_k`` of
    them); ``embedding_params`` is the token embedding and the output head (once when tied); ``moe`` the experts
    (:class:`~schedlang.autotune.moe_cost.MoEShape`; None: a dense model)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int
    flops_params: int
    embedding_params: int
    gated_mlp: bool = True
    tied: bool = False
    moe: Optional[MoEShape] = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a step runs: the mesh, data parallelism's engine and options, checkpointing, precision and speed-ups.

    ``dp`` is every data-parallel rank; ``dp_mode`` "fsdp" shards over all of them, "hsdp" shards over
    ``dp / dp_replicate`` and replicates over ``dp_replicate``, "ddp" replicates. ``microbatches`` split each dp
    rank's rows: a pipeline's microbatches, or gradient accumulation where ``pp == 1``."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    dp_mode: str = "fsdp"
    reshard: bool = True
    reduce_dtype: str = "fp32"
    activation_checkpoint: str = "none"
    sp: bool = False
    microbatches: int = 1
    stages_per_rank: int = 1
    pp_schedule: str = "1F1B"
    dtype: str = "bf16"
    optimize: bool = False
    compiled: bool = False
    optimizer: str = "adamw"
    dp_replicate: int = 1
    float8: bool = False
    #: context-parallel ranks: each holds ``1 / cp`` of every sequence; FSDP shards over ``dp x cp``
    cp: int = 1
    #: expert-parallel ranks, carved from ``dp x cp``: each holds ``1 / ep`` of every MoE layer's experts
    ep: int = 1

    def __post_init__(self):
        # True / False of the time when checkpointing was on or off
        ac = self.activation_checkpoint
        if ac is True or ac is False or ac is None:
            object.__setattr__(self, "activation_checkpoint", "full" if ac else "none")
        if self.dp_mode != "hsdp" and self.dp_replicate != 1:
            object.__setattr__(self, "dp_replicate", 1)

    @property
    def dp_shard(self) -> int:
        return 1 if self.dp_mode == "ddp" else self.dp // max(1, self.dp_replicate)

    @property
    def replicas(self) -> int:
        """Ranks holding the same shard: all dp ranks under DDP, ``dp_replicate`` under HSDP."""
        return self.dp if self.dp_mode == "ddp" else self.dp_replicate

    @property
    def recomputes(self) -> bool:
        return self.activation_checkpoint != "none"

    def mesh_sizes(self) -> Dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.replicas, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp}

    def describe(self) -> str:
        extras = []
        if self.sp:
            extras.append("sp")
        if self.dp * self.cp > 1:
            mode = (f"hsdp {self.dp_replicate}x{self.dp_shard}" if self.dp_mode == "hsdp" else self.dp_mode)
            extras.append(mode + ("" if self.reshard or self.dp_mode == "ddp" else " no-reshard")
                          + (" bf16-reduce" if self.reduce_dtype == "bf16" else ""))
        if self.pp > 1:
            extras.append(f"{self.pp_schedule} x{self.microbatches} mb"
                          + (f" v={self.stages_per_rank}" if self.stages_per_rank > 1 else ""))
        elif self.microbatches > 1:
            extras.append(f"{self.microbatches} accumulation steps")
        if self.activation_checkpoint == "full":
            extras.append("activation checkpointing")
        elif self.activation_checkpoint == "selective":
            extras.append("selective activation checkpointing")
        if self.float8:
            extras.append("float8")
        return (f"pp={self.pp} dp={self.dp} tp={self.tp}" + (f" cp={self.cp}" if self.cp > 1 else "")
                + (f" ep={self.ep}" if self.ep > 1 else "")
                + (f" ({', '.join(extras)})" if extras else ""))


@dataclasses.dataclass(frozen=True)
class Collective:
    """Collectives of one kind in a step: ``count`` calls of ``bytes_each`` payload bytes per rank on ``group``;
    ``wire_bytes`` is what each rank sends over the step (the ring algorithm's share), over ``link``."""

    what: str
    op: str
    group: str
    count: int
    bytes_each: float
    wire_bytes: float
    link: str = NVLINK
    seconds: float = 0.0


@dataclasses.dataclass
class StepEstimate:
    layout: Layout
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    gathered_bytes: float
    activation_bytes: float
    other_bytes: float
    #: what a layer's backward allocates on top of the activations it reads (its MLP's gradients and the residual
    #: stream's, FSDP's reduce-scatter input), with float8's copies of a layer's matmul inputs; counted in
    #: ``activation_bytes`` early in the backward and in ``backward_peak_bytes`` at its end
    working_bytes: float
    #: the gradients are allocated while the activations are (accumulated over microbatches, or a pipeline's)
    grads_in_forward: bool
    collectives: List[Collective]
    compute_s: float
    comm_s: float
    comm_exposed_s: float
    bubble_s: float
    optimizer_s: float
    tokens: int
    memory_limit: float
    #: what a checkpointed layer recomputes for its backward beyond what it saved (0 without checkpointing):
    #: in flight with ``working_bytes`` early in the backward, once the loss's backward has freed the logits
    recompute_bytes: float = 0.0
    #: the larger moment of a layer's backward beside the saved activations: at its MLP (with what it recomputed),
    #: at its norm (with FSDP2's unsharded weight gradients), plus the previous layer's reduce-scatter input where
    #: it outlives that layer's freed activations
    layer_backward_bytes: float = 0.0
    #: the logits and the loss's fp32 tensors at its backward (counted in ``activation_bytes`` where they are
    #: larger than a recomputed layer, which is in flight after them); 0 for a pipeline whose peak rank is the
    #: first, which holds no logits
    logits_bytes: float = 0.0
    global_batch: int = 0
    seq: int = 0
    #: a mixture of experts' facts and the load-imbalance assumption (None: a dense model)
    moe: Optional[Dict] = None
    #: the activations the peak rank frees before its gradients are whole: one microbatch's where it runs every
    #: microbatch's forward before its first backward (the gradients, zeroed after the last step, come with that
    #: backward); 0 where a step's gradients are whole while the rank still holds all it holds at the turn
    freed_before_grads_bytes: float = 0.0
    #: the build's peak from the meta device: the rank's stage in fp32 (tensor-parallel shards, before FSDP2 shards
    #: them over the data ranks) and the full-size copy of the largest module its init runs on
    build_bytes: float = 0.0

    @property
    def turn_grads_bytes(self) -> float:
        """The gradients counted with the activations: none where they are zeroed to None after each step; where
        they outlive a microbatch (accumulation, a pipeline), all of them, less the activations the first
        backward frees before they are whole (the larger of the two moments: its start, its end)."""
        if not self.grads_in_forward:
            return 0.0
        return max(0.0, self.grads_bytes - self.freed_before_grads_bytes)

    @property
    def forward_peak_bytes(self) -> float:
        """Early in the backward: the saved activations with the larger of the loss's backward and the first
        layer's (``activation_bytes``), the gradients only where they outlive the step (zeroed to None after each
        step otherwise)."""
        return self.gathered_bytes + self.activation_bytes + self.turn_grads_bytes

    @property
    def backward_peak_bytes(self) -> float:
        """At the end of the backward: every gradient, the gathered weights, a layer's backward."""
        return self.grads_bytes + self.gathered_bytes + self.working_bytes

    @property
    def total_bytes(self) -> float:
        """The step's peak per rank: what stays (weights, optimizer state, workspace) plus the larger moment."""
        return (self.params_bytes + self.optimizer_bytes + self.other_bytes
                + max(self.forward_peak_bytes, self.backward_peak_bytes))

    @property
    def peak_bytes(self) -> float:
        """The larger of the step's peak and the build's: what the device must hold."""
        return max(self.total_bytes, self.build_bytes)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_exposed_s + self.bubble_s + self.optimizer_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.memory_limit

    def as_dict(self) -> Dict:
        out = {k: getattr(self, k) for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "gathered_bytes",
                                             "activation_bytes", "logits_bytes", "recompute_bytes",
                                             "layer_backward_bytes", "working_bytes",
                                             "grads_in_forward", "forward_peak_bytes", "backward_peak_bytes",
                                             "other_bytes", "build_bytes", "compute_s", "comm_s", "comm_exposed_s",
                                             "bubble_s", "optimizer_s")}
        out.update(total_bytes=self.total_bytes, step_s=self.step_s, tokens_per_s=self.tokens_per_s,
                   layout=self.layout.describe(), fits=self.fits, moe=self.moe,
                   collectives=[dataclasses.asdict(c) for c in self.collectives])
        return out


def _bytes(dtype: str) -> int:
    return 2 if dtype == "bf16" else 4


def data_parallel_bytes(params: float, dp: int, dp_mode: str, reshard: bool, param_bytes: int,
                        reduce_bytes: int) -> List[Tuple[str, str, int, float, float]]:
    """``(what, op, calls, payload bytes, wire bytes)`` of one microbatch's data-parallel collectives over
    ``params`` (those of one rank's stage and tensor-parallel shard): FSDP2 all-gathers the weights (again in the
    backward when it reshards) and reduce-scatters the gradients; DDP all-reduces the gradients."""
    if dp < 2:
        return []
    share = (dp - 1) / dp
    if dp_mode == "ddp":
        payload = params * reduce_bytes
        return [("gradients", "all-reduce", 1, payload, 2 * share * payload)]
    gathers = 2 if reshard else 1
    weights = params * param_bytes
    grads = params * reduce_bytes
    return [("weights", "all-gather", gathers, weights, gathers * share * weights),
            ("gradients", "reduce-scatter", 1, grads, share * grads)]


def _stage_params(shape: ModelShape, pp: int) -> float:
    """Parameters of the pipeline stage that holds the most: the layers' share plus an embedding-sized end."""
    body = shape.params - shape.embedding_params
    if pp == 1:
        return shape.params
    return body / pp + shape.vocab * shape.hidden


def _residual_bytes(layout: Layout) -> int:
    # the residual stream: bf16 when FSDP2 computes in bf16, fp32 under autocast (fp32 weights) or in fp32
    return 2 if layout.dtype == "bf16" and layout.dp * layout.cp > 1 and layout.dp_mode in ("fsdp", "hsdp") else 4


def _activation_bytes_per_token(shape: ModelShape, layout: Layout) -> float:
    """Bytes one layer keeps for the backward per token of a microbatch without checkpointing (tensor-parallel
    parts split)."""
    c = _bytes(layout.dtype)
    r = _residual_bytes(layout)
    h, tp = shape.hidden, layout.tp
    q = shape.heads * shape.head_dim
    kv = shape.kv_heads * shape.head_dim
    # a norm keeps its input (+ the fp32 copy an unfused, uncompiled RMSNorm saves)
    norm = h * r + (0 if layout.optimize or layout.compiled else 4 * h)
    # the normed input (for the q/k/v weights' gradients), q, k and v as attention reads them (rotary embeddings
    # need no saved input), and attention's output (o_proj's input)
    attention = norm + h * c + (q + 2 * kv) * c / tp + q * c / tp
    # gated: gate and up (the activation's and the product's inputs), act(gate) and the product (down's input);
    # a compiled layer recomputes the activation in the backward. Plain: fc1's output and the activation's.
    mlp_tensors = (3 if layout.compiled else 4) if shape.gated_mlp else 2
    imbalance = LOAD_IMBALANCE if layout.ep > 1 else 1.0
    mlp = norm + h * c + mlp_tensors * mean_mlp_width(shape.layers, shape.intermediate, shape.moe, imbalance) * c / tp
    if shape.moe is not None:  # a MoE layer's routed copies of its input and its experts' outputs before the sum
        mlp += 2 * shape.moe.top_k * imbalance * h * c * shape.moe.moe_layers / shape.layers
    per_token = attention + mlp
    if layout.sp:
        # the norms' inputs (the residual stream) are split along the sequence; the normed inputs of q/k/v and of
        # the MLP are all-gathered to the whole sequence before their matmuls, which keep that gathered copy
        per_token -= 2 * norm * (1 - 1 / tp)
    return per_token


def _backward_working_bytes_per_token(shape: ModelShape, layout: Layout) -> float:
    """What a layer's backward allocates per token on top of the activations it reads, at its MLP: the MLP's
    gradients, the largest set at once (gate's, up's and their product's in a gated MLP; fc1's and the activation's
    in a plain one), the input gradients of its first matmuls (gate's and up's, or fc1's), which are the whole hidden
    width on every tp rank (partial sums, reduced after), and the gradient of the residual stream."""
    c, tp = _bytes(layout.dtype), layout.tp
    imbalance = LOAD_IMBALANCE if layout.ep > 1 else 1.0
    width = mean_mlp_width(shape.layers, shape.intermediate, shape.moe, imbalance)
    first_matmuls = 2 if shape.gated_mlp else 1
    # the residual stream's gradient is a layer's input in size
    return (first_matmuls + 1) * width * c / tp + first_matmuls * shape.hidden * c + _layer_input_bytes(shape, layout)


def _norm_backward_bytes_per_token(shape: ModelShape, layout: Layout) -> float:
    """What a layer's norm's backward allocates per token, at the end of the layer's backward: the residual stream's
    gradient in and out and, for an unfused, uncompiled RMSNorm, which runs in fp32 op by op, fp32 copies of its
    input (the whole hidden width unless the sequence is split): larger than the MLP's at tp 4 without SP."""
    copies = 0 if layout.optimize or layout.compiled else _EAGER_NORM_BACKWARD_COPIES
    return copies * 4 * shape.hidden / (layout.tp if layout.sp else 1) + 2 * _layer_input_bytes(shape, layout)


def _layer_input_bytes(shape: ModelShape, layout: Layout) -> float:
    """A layer's input per token: what full checkpointing keeps (split along the sequence under SP)."""
    return shape.hidden * _residual_bytes(layout) / (layout.tp if layout.sp else 1)


def _layer_matmuls(shape: ModelShape) -> List[Tuple[int, int, bool]]:
    """``(in, out, row_parallel)`` of a layer's matmuls in call order (q, k, v, o, then gate, up, down or fc1, fc2)."""
    h, i = shape.hidden, mean_mlp_width(shape.layers, shape.intermediate, shape.moe)
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention = [(h, q, False), (h, kv, False), (h, kv, False), (q, h, True)]
    mlp = [(h, i, False), (h, i, False), (i, h, True)] if shape.gated_mlp else [(h, i, False), (i, h, True)]
    return attention + mlp


def _selective_bytes_per_token(shape: ModelShape, layout: Layout) -> float:
    """What op-level selective checkpointing keeps per token and layer: the layer's input, every other matmul's
    output (the first, third ...; a row-parallel one's whole partial sum), attention's output and log-sum-exp."""
    c, tp = _bytes(layout.dtype), layout.tp
    # a compiled layer does not keep a row-parallel matmul's output (o, down): only the residual add reads it, and
    # its backward needs none of it; eager checkpointing's cache keeps every output the policy names
    saved = sum(out / (1 if row else tp) for k, (_, out, row) in enumerate(_layer_matmuls(shape))
                if k % 2 == 0 and not (row and layout.compiled))
    attention = shape.heads * shape.head_dim * c / tp + 4 * shape.heads / tp
    return _layer_input_bytes(shape, layout) + saved * c + attention


def selective_recompute_share(shape: ModelShape) -> float:
    """The share of a layer's matmul flops selective checkpointing recomputes (the second, fourth ... matmuls)."""
    sizes = [a * b for a, b, _ in _layer_matmuls(shape)]
    return sum(s for k, s in enumerate(sizes) if k % 2 == 1) / sum(sizes)


def saved_bytes_per_token(shape: ModelShape, layout: Layout) -> float:
    """What one layer keeps for the backward, per token of a microbatch, under the layout's checkpointing."""
    if layout.activation_checkpoint == "full":
        return _layer_input_bytes(shape, layout)
    if layout.activation_checkpoint == "selective":
        return _selective_bytes_per_token(shape, layout)
    return _activation_bytes_per_token(shape, layout)


def _recompute_flops_per_token(shape: ModelShape, layout: Layout, seq: int) -> float:
    """Forward flops per token that checkpointing runs again in the backward. Full: every layer's forward but its
    last matmul (down or fc2), whose output no backward reads, so the recomputation stops before it; attention's
    forward at its causal cost (flash attention skips the masked half). Selective: the policy's recomputed
    matmuls (the norms, rotary embeddings and the activation are elementwise: no flops worth counting)."""
    if layout.activation_checkpoint == "full":
        last_in, last_out, _ = _layer_matmuls(shape)[-1]
        attention = 2 * shape.layers * shape.hidden * seq
        return 2 * (_layer_gemm_params(shape) - shape.layers * last_in * last_out) + attention
    return 2 * _layer_gemm_params(shape) * selective_recompute_share(shape)


def _layer_gemm_params(shape: ModelShape) -> float:
    return shape.layers * sum(a * b for a, b, _ in _layer_matmuls(shape))


def _gathers_per_step(layout: Layout, layers: int) -> Tuple[int, int]:
    """``(all-gathers, reduce-scatters)`` of one FSDP unit per step. Without a pipeline each microbatch runs a
    whole forward and backward: it gathers in the forward and, resharding, again in the backward, and
    reduce-scatters its gradients. A pipeline schedule keeps the weights gathered after the first backward and
    reduces the gradients once, after the last microbatch (torch.distributed.pipelining's FSDP handling); its
    forwards still reshard when resharding is on."""
    m = layout.microbatches
    if layout.pp == 1:
        return (2 if layout.reshard else 1) * m, m
    return (m + 1 if layout.reshard else 1), 1


def _layers_in_flight(layout: Layout, layers: int, pp_rank: int = 0) -> float:
    """Layer-microbatches whose activations pipeline rank ``pp_rank`` keeps at once (``layers`` per rank).

    GPipe runs every forward before any backward, on every rank. torch's 1F1B runs ``pp - r`` forwards on rank
    ``r`` before its first backward: ``pp`` microbatches on the first rank, one on the last. The interleaved schedule warms rank ``r`` up with ``(v - 1) pp + 2 (pp - 1 - r)`` forwards of
    a stage (``layers / v`` layers each) and runs one more before its first backward. A steady phase pairs each
    forward with a backward, so the count before the first backward is the rank's peak. torch takes the
    microbatches in rounds of ``m // max(1, m // pp)`` (``pp`` where ``pp`` divides ``m``), which replace ``pp``
    in the interleaved warm-up."""
    pp, v, m = layout.pp, layout.stages_per_rank, layout.microbatches
    if pp == 1:
        return layers
    if layout.pp_schedule == "GPipe":
        return m * layers
    if v == 1:
        return min(m, pp - pp_rank) * layers
    per_round = m // max(1, m // pp)
    return min(m * v, (v - 1) * per_round + 2 * (pp - 1 - pp_rank) + 1) * layers / v


def _pipeline_rank_bytes(layout: Layout, layers: int, per_layer: float, boundary: float,
                         pp_rank: int) -> Tuple[float, float]:
    """``(held, freed before the gradients)`` of pipeline rank ``pp_rank`` at its first backward: the saved
    activations of its layer-microbatches in flight (``per_layer`` bytes each) and, for each stage-microbatch in
    flight whose output goes to the next rank, that output (``boundary`` bytes), which torch's stage keeps for
    the backward, plus one gradient receive buffer per stage-microbatch, which it allocates once and keeps, and
    for each stage that receives its input from another rank one input receive buffer per microbatch.
    Where every stage-microbatch runs its forward before the first backward (GPipe; 1F1B with ``m <= pp -
    rank``), the gradients come with that backward, and are whole once it has freed its stage-microbatch."""
    pp, v, m = layout.pp, layout.stages_per_rank, layout.microbatches
    in_flight = _layers_in_flight(layout, layers, pp_rank)
    stage_microbatches = in_flight * v / layers
    # the stages whose output goes on: all of a rank's but the last rank's last (the model's end)
    sending = 1.0 if pp_rank < pp - 1 else (v - 1) / v
    # the stages that receive their input from another rank (all but the model's first) keep one receive buffer
    # per microbatch, allocated once
    receiving = v - 1 if pp_rank == 0 else v
    held = in_flight * per_layer + boundary * (sending * (stage_microbatches + m * v) + receiving * m)
    freed = per_layer * layers / v + sending * boundary if stage_microbatches >= m * v else 0.0
    return held, freed


def estimate_step(shape: ModelShape, layout: Layout, hw: Hardware, global_batch: int, seq: int) -> StepEstimate:
    """Memory per rank, collectives and time of one step of ``global_batch`` sequences of ``seq`` tokens."""
    pp, dp, tp, cp, ep = layout.pp, layout.dp, layout.tp, layout.cp, layout.ep
    world = pp * dp * cp * tp
    moe = shape.moe
    ep = ep if moe is not None else 1
    layers = math.ceil(shape.layers / pp)
    # data parallelism runs on the data dimension and cp flattened (each cp rank's gradient covers its tokens
    # only): FSDP shards over both, DDP all-reduces over both
    data = dp * cp
    sharded = data > 1 and layout.dp_mode in ("fsdp", "hsdp")
    shard = layout.dp_shard * cp if sharded else 1
    # the routed experts: 1 / ep of them per rank, sharded by FSDP over the shard group's other ranks
    experts = moe.expert_params / pp / tp if moe is not None else 0.0
    expert_shard = max(1, shard // ep)
    stage = _stage_params(shape, pp) / tp - experts + experts / ep  # what one rank holds before FSDP shards it
    local = (stage - experts / ep) / shard + experts / ep / expert_shard
    compute_bytes = _bytes(layout.dtype)
    reduce_bytes = 2 if layout.reduce_dtype == "bf16" else 4
    params_bytes = 4 * local
    grads_bytes = 4 * local + (stage * reduce_bytes if data > 1 and not sharded else 0)  # DDP's gradient buckets
    optimizer_bytes = (8 if layout.optimizer != "sgd" else 4) * local
    gathered = 0.0
    per_layer = layer_params = (stage - shape.embedding_params / tp) / max(1, layers)
    if sharded and pp > 1:
        # torch.distributed.pipelining runs FSDP2 without resharding after the backward and without reducing the
        # gradients before the last microbatch: the stage's weights stay gathered and its gradients accumulate
        # unsharded in the reduce dtype
        gathered = compute_bytes * stage
        grads_bytes += reduce_bytes * stage
    elif sharded:
        ends = shape.embedding_params / tp
        gathered = compute_bytes * (ends + (stage - ends if not layout.reshard else 2 * per_layer))
    elif layout.dtype == "bf16" and layout.recomputes and layout.compiled:
        # autocast's bf16 copies of the weights: a checkpointed compiled layer casts its weights inside its graph
        # and saves nothing but its input, so only the output head's copy (outside the layers) and the copies of
        # the layer being recomputed are alive (eager autocast caches every cast until the forward ends)
        gathered = 2 * (shape.vocab * shape.hidden / tp + per_layer)
    elif layout.dtype == "bf16":  # autocast's bf16 copies of the weights, saved for the backward
        gathered = 2 * stage
    if layout.float8:  # a layer's float8 weight and its transpose, cast for its matmuls
        gathered += 2 * per_layer
    rows_per_rank = global_batch / dp
    microbatch_tokens = rows_per_rank / layout.microbatches * seq / cp  # this rank's share of each sequence
    per_token = _activation_bytes_per_token(shape, layout)
    saved = saved_bytes_per_token(shape, layout)
    acts = microbatch_tokens * _layers_in_flight(layout, layers) * saved
    freed = 0.0
    logits = 0.0
    if not layout.optimize or tp > 1:
        # at the loss's backward: the logits, the log-softmax's fp32 output (saved), its gradient and the
        # gradient of the logits' fp32 copy
        logits = microbatch_tokens * shape.vocab / tp * (compute_bytes + 12)
    # the two moments of the backward with the most in flight besides the saved activations: the loss's backward
    # (the logits) and, after it has freed them, a layer's backward: what the layer recomputes beyond what it
    # saved, and what its backward allocates
    mlp_working = microbatch_tokens * _backward_working_bytes_per_token(shape, layout)
    norm_working = microbatch_tokens * _norm_backward_bytes_per_token(shape, layout)
    recompute = microbatch_tokens * (per_token - saved) if layout.recomputes else 0.0
    working = max(mlp_working, norm_working)
    norm_moment, previous_reduce_scatter = norm_working, 0.0
    if sharded and pp == 1:
        # FSDP2 computes a layer's weight gradients unsharded in the compute dtype (whole at the layer's end), and
        # keeps the reduce-scatter input it copies them into (the unsharded gradient in the reduce dtype) until
        # the next layer's reduce-scatter: through the next layer's backward, once the layer's own activations
        # are freed
        reduce_scatter_input = reduce_bytes * layer_params
        norm_moment += compute_bytes * layer_params
        previous_reduce_scatter = max(0.0, reduce_scatter_input - microbatch_tokens * saved)
        working += reduce_scatter_input  # at the end of the backward, beside every gradient
    # a layer's backward: at its MLP, with what it recomputed; at its end, at its norm
    layer_backward = max(recompute + mlp_working, norm_moment) + previous_reduce_scatter
    # gradients outlive the forward when microbatches accumulate into them (and in a pipeline's schedule)
    grads_in_forward = layout.microbatches > 1 or pp > 1
    if pp > 1:
        # the logits live on the last pipeline rank, which keeps the fewest microbatches in flight; the first rank
        # keeps the most and no logits: the rank with the larger sum sets the peak (the stages are equal in size)
        boundary = microbatch_tokens * _layer_input_bytes(shape, layout)
        # beside the hidden states, the values later stages use are relayed: the rotary embeddings' cos and sin
        # and the position ids (sent as float64), one row for the microbatch
        boundary += seq / cp * (2 * shape.head_dim * compute_bytes + 8)
        per_layer = microbatch_tokens * saved
        acts, freed = _pipeline_rank_bytes(layout, layers, per_layer, boundary, 0)
        last, last_freed = _pipeline_rank_bytes(layout, layers, per_layer, boundary, pp - 1)
        acts += layer_backward
        last += max(logits, layer_backward)
        if last + max(0.0, grads_bytes - last_freed) <= acts + max(0.0, grads_bytes - freed):
            logits = 0.0
        else:
            acts, freed = last, last_freed
    else:
        acts += max(logits, layer_backward)
    other = _CUDA_ALLOWANCE if hw.device == "cuda" else 0.0
    # the build from the meta device allocates the rank's stage in fp32 (a pipeline rank its own stages only)
    # before data parallelism shards it, each module initialized on a temporary full-size copy: the largest is the
    # embedding or output head, whole (a layer's Linears are smaller)
    build = 4 * stage + 4 * shape.vocab * shape.hidden + other

    # -- time
    tokens = global_batch * seq
    flops_per_token = 6 * shape.flops_params + 12 * shape.layers * shape.hidden * seq
    gemm = 6 * _layer_gemm_params(shape)  # the layers' matmuls: what float8 speeds up
    efficiency = _EFFICIENCY["optimize" if layout.optimize and layout.compiled else
                             "compile" if layout.compiled else "eager"] if hw.device == "cuda" else 1.0
    if layout.recomputes:
        extra = _recompute_flops_per_token(shape, layout, seq)
        # recomputation is forward matmuls (and flash attention's forward), which run at a plain GEMM's rate, not
        # at the step's average rate (which the backward's attention and the elementwise kernels pull down)
        rate = max(efficiency, _FORWARD_GEMM_EFFICIENCY) if hw.device == "cuda" else 1.0
        flops_per_token += extra * efficiency / rate
        gemm += extra
    if layout.float8 and hw.device == "cuda" and any(k in hw.name for k in FLOAT8_DEVICES):
        flops_per_token -= gemm / 2  # float8 GEMMs at twice the bf16 rate
    if ep > 1:  # the step waits for the rank whose experts received the most tokens
        flops_per_token += 6 * moe.active_expert_params * (LOAD_IMBALANCE - 1)
    compute = tokens * flops_per_token / (world * hw.peak_flops * efficiency)
    sizes = layout.mesh_sizes()
    collectives: List[Collective] = []

    def add(what: str, op: str, dim: str, group: str, count: int, each: float, wire: float) -> None:
        link, speed = hw.link(sizes, dim)
        collectives.append(Collective(what, op, group, count, each, wire, link, wire / speed))

    m = layout.microbatches
    if sharded:
        gathers, reductions = _gathers_per_step(layout, layers)
        engine = "HSDP" if layout.dp_mode == "hsdp" else "FSDP2"
        group = "dp_shard" if layout.dp_mode == "hsdp" else "dp"
        # the routed experts' shards live on the shard group's ranks outside their expert-parallel group
        parts = [("", stage - experts / ep, shard)] if ep > 1 else [("", stage, shard)]
        if ep > 1:
            parts.append((" of the experts", experts / ep, expert_shard))
        for what, params, ranks in parts:
            if ranks < 2:
                continue
            share = (ranks - 1) / ranks
            weights = params * compute_bytes
            add(f"{engine} weights{what}", "all-gather", "dp_shard", group, gathers * layers, weights / layers,
                gathers * share * weights)
            grads = params * reduce_bytes
            add(f"{engine} gradients{what}", "reduce-scatter", "dp_shard", group, reductions * layers,
                grads / layers, reductions * share * grads)
        if layout.dp_mode == "hsdp" and layout.dp_replicate > 1:
            # the gradient shards summed over the replicas once per step (accumulating microbatches skip it)
            r = layout.dp_replicate
            piece = local * reduce_bytes
            add("HSDP gradient shards", "all-reduce", "dp_replicate", "dp_replicate", layers, piece / layers,
                2 * (r - 1) / r * piece)
    elif data > 1:  # DDP: the gradients summed once per step (accumulating microbatches skip it)
        payload = stage * reduce_bytes
        add("DDP gradients", "all-reduce", "dp_replicate", "dp", 1, payload, 2 * (data - 1) / data * payload)
    dp_comm = sum(c.seconds for c in collectives)
    # hidden behind the layers' compute, but for the first gather and the last reduction, and the SMs it takes
    dp_exposed = max(0.0, dp_comm - 0.8 * compute) + _CONTENTION * dp_comm + dp_comm / max(1, layers) if data > 1 else 0
    tp_comm = 0.0
    if tp > 1:
        activation = microbatch_tokens * shape.hidden * compute_bytes  # one microbatch's activations
        calls = (4 * layers + (2 * layers if layout.activation_checkpoint == "full" else
                               layers if layout.activation_checkpoint == "selective" else 0)) * m
        share = (tp - 1) / tp
        if layout.sp:
            add("sequence-parallel activations", "all-gather", "tp", "tp", calls, activation / tp,
                calls * share * activation)
            add("sequence-parallel activations", "reduce-scatter", "tp", "tp", calls, activation,
                calls * share * activation)
        else:
            add("tensor-parallel activations", "all-reduce", "tp", "tp", calls, activation,
                calls * 2 * share * activation)
        tp_comm = sum(c.seconds for c in collectives if c.group == "tp")
    cp_comm = 0.0
    if cp > 1:
        # each layer all-gathers K and V over cp in the forward (again when it is recomputed) and reduce-scatters
        # their gradients in the backward: the whole sequence's K/V of this rank's kv heads
        kv = microbatch_tokens * cp * 2 * shape.kv_heads * shape.head_dim / tp * compute_bytes
        forwards = (2 if layout.activation_checkpoint == "full" else 1) * layers * m
        share = (cp - 1) / cp
        add("context-parallel keys and values", "all-gather", "cp", "cp", forwards, kv, forwards * share * kv)
        add("context-parallel key and value gradients", "reduce-scatter", "cp", "cp", layers * m, kv,
            layers * m * share * kv)
        cp_comm = sum(c.seconds for c in collectives if c.group == "cp")
        working += kv  # one layer's gathered keys and values
    ep_comm = 0.0
    if ep > 1:
        # each MoE layer sends its routed tokens to their experts' ranks and the outputs back (dispatch, combine),
        # and the gradients the same way in the backward (again in a full checkpoint's recomputation); the busiest
        # rank's share is LOAD_IMBALANCE x the mean. Nothing overlaps it: the experts wait for their tokens
        moe_layers = math.ceil(moe.moe_layers / pp)
        calls = (6 if layout.activation_checkpoint == "full" else 4) * moe_layers * m
        each = all_to_all_bytes(microbatch_tokens, moe, shape.hidden, compute_bytes) * LOAD_IMBALANCE
        link, speed = hw.link_of_group(ep, tp)
        wire = calls * (ep - 1) / ep * each
        collectives.append(Collective("expert-parallel token dispatch and combine", "all-to-all", "ep", calls, each,
                                      wire, link, wire / speed))
        ep_comm = wire / speed
    bubble = 0.0
    pp_comm = 0.0
    if pp > 1:
        v = layout.stages_per_rank
        bubble = compute * (pp - 1) / (m * v)  # (pp - 1) idle slots of a microbatch's share of one stage
        boundary = microbatch_tokens * shape.hidden * compute_bytes
        add("pipeline activations and their gradients", "send/recv", "pp", "pp", 2 * m * v, boundary,
            2 * m * v * boundary)
        pp_comm = collectives[-1].seconds
    step_bytes_per_param = 28 if layout.optimizer != "sgd" else 16  # read p, g, m, v; write p, m, v
    optimizer = local * (step_bytes_per_param + 12) / hw.memory_bandwidth  # + the gradient norm and clipping
    comm = dp_comm + tp_comm + pp_comm + cp_comm + ep_comm
    moe_facts = None
    if moe is not None:
        moe_facts = {"experts": moe.experts, "top_k": moe.top_k, "moe_layers": moe.moe_layers,
                     "expert_params": moe.expert_params, "active_expert_params": moe.active_expert_params,
                     "ep": ep, "experts_per_rank": moe.experts // ep,
                     "load_imbalance": LOAD_IMBALANCE if ep > 1 else 1.0}
    return StepEstimate(layout=layout, params_bytes=params_bytes, grads_bytes=grads_bytes,
                        optimizer_bytes=optimizer_bytes, gathered_bytes=gathered, activation_bytes=acts,
                        other_bytes=other, working_bytes=working, grads_in_forward=grads_in_forward,
                        collectives=collectives, compute_s=compute, comm_s=comm,
                        comm_exposed_s=dp_exposed + tp_comm + pp_comm + cp_comm + ep_comm, bubble_s=bubble,
                        optimizer_s=optimizer, tokens=tokens, memory_limit=USABLE_MEMORY * hw.memory_bytes,
                        logits_bytes=logits, recompute_bytes=recompute,
                        layer_backward_bytes=layer_backward, global_batch=global_batch, seq=seq, moe=moe_facts,
                        freed_before_grads_bytes=freed, build_bytes=build)

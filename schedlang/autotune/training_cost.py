"""The cost of one training step of a decoder-only transformer under a layout, before anything runs.

:func:`estimate_step` gives, per rank, the memory of the parameters (fp32 master weights), the
gradients, the optimizer's state, FSDP2's gathered weights and the activations, the collectives
of a step with their bytes, and the step time: the model's flops at a fraction of the devices'
peak, plus what the communication adds where it cannot hide behind compute, the pipeline's
bubble and the memory-bound optimizer step. :func:`candidate_layouts` lists the layouts of a
world (``pp x dp x tp``, FSDP2 or DDP, resharding, the reduce dtype, activation checkpointing)
and :func:`choose_layout` picks the fastest that fits, with its reasons.

The figures are estimates: activations are counted tensor by tensor for a pre-norm decoder
(attention and a gated or plain MLP), which is what HF's causal LMs are; allocator slack and
library workspaces are a fixed allowance. The memory is the step's peak, the larger of two moments:
the turn from forward to backward (every layer's activations, one layer's working set, and the
gradients only where they outlive a step: accumulation over microbatches) and the end of the backward
(every gradient, one layer's working set). ``bench/train_memory.py`` measures the peak layout by layout
against this estimate (``bench/results/*-train-memory.json``), as the trainer's metrics do
(``mem_gib`` against ``mem_estimated_gib``).

Example::

    shape = ModelShape(layers=22, hidden=2048, heads=16, kv_heads=16, head_dim=128, intermediate=5632,
                       vocab=32000, params=1_100_048_384, flops_params=1_034_512_384,
                       embedding_params=131_072_000)
    hw = Hardware.nominal("cuda", memory_gib=141, link_gbps=300)
    choice = choose_layout(shape, hw, world=2, global_batch=8, seq=2048)
    print(choice.reason)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["ModelShape", "Hardware", "Layout", "Collective", "StepEstimate", "Choice", "estimate_step",
           "candidate_layouts", "choose_layout", "data_parallel_bytes", "format_estimate", "GIB"]

GIB = 2 ** 30
#: devices' dense bf16 peak and memory bandwidth, by name (the first match wins)
_DEVICES = (("H200", 989e12, 4.8e12), ("H100", 989e12, 3.35e12), ("A100", 312e12, 2.0e12), ("L40", 181e12, 0.86e12))
#: what a device without a known name is taken to be
_UNKNOWN_GPU = (100e12, 1.0e12)
#: a CPU rank: an order of magnitude for the estimate only
_CPU = (5e10, 2e10)
#: fraction of the peak a step reaches: compiled layers with optimize_model, compiled, eager (bench/bench_train.py)
_EFFICIENCY = {"optimize": 0.48, "compile": 0.42, "eager": 0.33}
#: the share of overlapped communication that still costs time (its kernels take SMs and memory bandwidth)
_CONTENTION = 0.1
#: bytes a CUDA rank holds besides the tensors counted here (cuBLAS workspace, allocator slack)
_CUDA_ALLOWANCE = 0.5 * GIB
#: the part of a device's memory a layout may plan to use
USABLE_MEMORY = 0.9


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer. ``params`` counts tied weights once; ``flops_params`` leaves out
    the embedding lookups; ``embedding_params`` is the token embedding and the output head (once when tied)."""

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


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One rank's device and the link between ranks. ``link_source``: "measured", "given" or "nominal"."""

    device: str
    name: str
    memory_bytes: float
    peak_flops: float
    memory_bandwidth: float
    link_bytes_per_s: float
    link_source: str = "nominal"

    @classmethod
    def nominal(cls, device: str, name: str = "", memory_gib: Optional[float] = None,
                link_gbps: Optional[float] = None, world: int = 2) -> "Hardware":
        """A device by its name (``torch.cuda.get_device_name``), its memory and link, where not measured."""
        if device == "cuda":
            peak, bandwidth = next(((p, b) for key, p, b in _DEVICES if key in name), _UNKNOWN_GPU)
            if not name:  # planning for a GPU without one at hand: an H100 / H200-class device
                peak, bandwidth = _DEVICES[1][1:]
            memory = (memory_gib if memory_gib is not None else 80.0) * GIB
            link = link_gbps * 1e9 if link_gbps is not None else 300e9  # NVLink-class bus bandwidth of NCCL
        else:
            peak, bandwidth = _CPU
            memory = (memory_gib if memory_gib is not None else 16.0) * GIB
            link = link_gbps * 1e9 if link_gbps is not None else 2e9
        return cls(device, name or ("GPU" if device == "cuda" else "CPU"), memory, peak, bandwidth, link,
                   "given" if link_gbps is not None else "nominal")

    def with_link(self, bytes_per_s: float, source: str) -> "Hardware":
        return dataclasses.replace(self, link_bytes_per_s=bytes_per_s, link_source=source)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a step runs: the mesh, data parallelism's engine and options, checkpointing, precision and speed-ups."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    dp_mode: str = "fsdp"
    reshard: bool = True
    reduce_dtype: str = "fp32"
    activation_checkpoint: bool = False
    sp: bool = False
    microbatches: int = 1
    stages_per_rank: int = 1
    pp_schedule: str = "1F1B"
    dtype: str = "bf16"
    optimize: bool = False
    compiled: bool = False
    optimizer: str = "adamw"

    def describe(self) -> str:
        extras = []
        if self.sp:
            extras.append("sp")
        if self.dp > 1:
            extras.append(self.dp_mode + ("" if self.reshard or self.dp_mode != "fsdp" else " no-reshard")
                          + (" bf16-reduce" if self.reduce_dtype == "bf16" else ""))
        if self.pp > 1:
            extras.append(f"{self.pp_schedule} x{self.microbatches} mb")
        if self.activation_checkpoint:
            extras.append("activation checkpointing")
        return f"pp={self.pp} dp={self.dp} tp={self.tp}" + (f" ({', '.join(extras)})" if extras else "")


@dataclasses.dataclass(frozen=True)
class Collective:
    """Collectives of one kind in a step: ``count`` calls of ``bytes_each`` payload bytes per rank on ``group``;
    ``wire_bytes`` is what each rank sends over the step (the ring algorithm's share)."""

    what: str
    op: str
    group: str
    count: int
    bytes_each: float
    wire_bytes: float


@dataclasses.dataclass
class StepEstimate:
    layout: Layout
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    gathered_bytes: float
    activation_bytes: float
    other_bytes: float
    #: the activations of one layer: what is in flight on top of the saved ones when the backward starts
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

    @property
    def forward_peak_bytes(self) -> float:
        """At the turn from forward to backward: saved activations, one layer's working set, the gradients only
        where they outlive the step (zeroed to None after each step otherwise)."""
        return (self.gathered_bytes + self.activation_bytes + self.working_bytes
                + (self.grads_bytes if self.grads_in_forward else 0.0))

    @property
    def backward_peak_bytes(self) -> float:
        """At the end of the backward: every gradient, the gathered weights, one layer's working set."""
        return self.grads_bytes + self.gathered_bytes + self.working_bytes

    @property
    def total_bytes(self) -> float:
        """The step's peak per rank: what stays (weights, optimizer state, workspace) plus the larger moment."""
        return (self.params_bytes + self.optimizer_bytes + self.other_bytes
                + max(self.forward_peak_bytes, self.backward_peak_bytes))

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_exposed_s + self.bubble_s + self.optimizer_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.memory_limit

    def as_dict(self) -> Dict:
        out = {k: getattr(self, k) for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "gathered_bytes",
                                             "activation_bytes", "working_bytes", "grads_in_forward",
                                             "forward_peak_bytes", "backward_peak_bytes", "other_bytes",
                                             "compute_s", "comm_s",
                                             "comm_exposed_s", "bubble_s", "optimizer_s")}
        out.update(total_bytes=self.total_bytes, step_s=self.step_s, tokens_per_s=self.tokens_per_s,
                   layout=self.layout.describe(), fits=self.fits,
                   collectives=[dataclasses.asdict(c) for c in self.collectives])
        return out


def _bytes(dtype: str) -> int:
    return 2 if dtype == "bf16" else 4


def data_parallel_bytes(params: float, dp: int, dp_mode: str, reshard: bool, param_bytes: int,
                        reduce_bytes: int) -> List[Tuple[str, str, int, float, float]]:
    """``(what, op, calls, payload bytes, wire bytes)`` of a step's data-parallel collectives over ``params``
    (those of one rank's stage and tensor-parallel shard): FSDP2 all-gathers the weights (again in the backward
    when it reshards) and reduce-scatters the gradients; DDP all-reduces the gradients."""
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


def _activation_bytes_per_token(shape: ModelShape, layout: Layout) -> float:
    """Bytes one layer keeps for the backward per token of a microbatch (tensor-parallel parts split)."""
    c = _bytes(layout.dtype)
    # the residual stream: bf16 when FSDP2 computes in bf16, fp32 under autocast (fp32 weights) or in fp32
    r = 2 if layout.dtype == "bf16" and layout.dp > 1 and layout.dp_mode == "fsdp" else 4
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
    mlp = norm + h * c + mlp_tensors * shape.intermediate * c / tp
    per_token = attention + mlp
    if layout.sp:  # the norms' and residuals' activations split along the sequence as well
        per_token -= (2 * norm + 2 * h * c) * (1 - 1 / tp)
    return per_token


def estimate_step(shape: ModelShape, layout: Layout, hw: Hardware, global_batch: int, seq: int) -> StepEstimate:
    """Memory per rank, collectives and time of one step of ``global_batch`` sequences of ``seq`` tokens."""
    pp, dp, tp = layout.pp, layout.dp, layout.tp
    world = pp * dp * tp
    stage = _stage_params(shape, pp) / tp
    layers = math.ceil(shape.layers / pp)
    fsdp = dp > 1 and layout.dp_mode == "fsdp"
    local = stage / dp if fsdp else stage
    compute_bytes = _bytes(layout.dtype)
    reduce_bytes = 2 if layout.reduce_dtype == "bf16" else 4
    params_bytes = 4 * local
    grads_bytes = 4 * local + (stage * reduce_bytes if dp > 1 and not fsdp else 0)  # DDP's gradient buckets
    optimizer_bytes = (8 if layout.optimizer != "sgd" else 4) * local
    gathered = 0.0
    if fsdp:
        per_layer = (stage - shape.embedding_params / tp) / max(1, layers)
        ends = shape.embedding_params / tp if pp == 1 else shape.vocab * shape.hidden / tp
        gathered = compute_bytes * (ends + (stage - ends if not layout.reshard else 2 * per_layer))
    elif layout.dtype == "bf16":  # autocast's bf16 copies of the weights, saved for the backward
        gathered = 2 * stage
    rows_per_rank = global_batch / dp
    microbatch_tokens = rows_per_rank / layout.microbatches * seq
    in_flight = 1
    if pp > 1:
        v = layout.stages_per_rank
        in_flight = layout.microbatches if layout.pp_schedule == "GPipe" else min(layout.microbatches, pp * v)
    per_token = _activation_bytes_per_token(shape, layout)
    if layout.activation_checkpoint:  # each layer keeps its input; one layer's activations while recomputing
        r = 2 if compute_bytes == 2 and fsdp else 4
        acts = microbatch_tokens * in_flight * (layers * shape.hidden * r) + microbatch_tokens * per_token
    else:
        acts = microbatch_tokens * in_flight * layers * per_token
    if not layout.optimize or tp > 1:  # the logits, their fp32 copy and their gradient
        acts += microbatch_tokens * shape.vocab / tp * (compute_bytes + 8)
    working = microbatch_tokens * per_token
    # gradients outlive the forward when microbatches accumulate into them (and in a pipeline's schedule)
    grads_in_forward = layout.microbatches > 1 or pp > 1
    other = _CUDA_ALLOWANCE if hw.device == "cuda" else 0.0

    # -- time
    tokens = global_batch * seq
    flops_per_token = 6 * shape.flops_params + 12 * shape.layers * shape.hidden * seq
    if layout.activation_checkpoint:
        flops_per_token *= 4 / 3  # the forward once more
    efficiency = _EFFICIENCY["optimize" if layout.optimize and layout.compiled else
                             "compile" if layout.compiled else "eager"] if hw.device == "cuda" else 1.0
    compute = tokens * flops_per_token / (world * hw.peak_flops * efficiency)
    collectives: List[Collective] = []
    link = hw.link_bytes_per_s
    for what, op, calls, payload, wire in data_parallel_bytes(stage, dp, layout.dp_mode, layout.reshard,
                                                               compute_bytes, reduce_bytes):
        per_call = payload / (layers if op != "all-reduce" else 1)
        count = calls * (layers if op != "all-reduce" else 1)
        collectives.append(Collective(f"{'FSDP2' if fsdp else 'DDP'} {what}", op, "dp", count, per_call, wire))
    dp_comm = sum(c.wire_bytes for c in collectives) / link
    # hidden behind the layers' compute, but for the first gather and the last reduction, and the SMs it takes
    dp_exposed = max(0.0, dp_comm - 0.8 * compute) + _CONTENTION * dp_comm + dp_comm / max(1, layers) if dp > 1 else 0
    tp_comm = 0.0
    if tp > 1:
        activation = rows_per_rank * seq * shape.hidden * compute_bytes
        calls = 4 * layers + (2 * layers if layout.activation_checkpoint else 0)
        share = (tp - 1) / tp
        if layout.sp:
            collectives.append(Collective("sequence-parallel activations", "all-gather", "tp", calls, activation / tp,
                                          calls * share * activation))
            collectives.append(Collective("sequence-parallel activations", "reduce-scatter", "tp", calls, activation,
                                          calls * share * activation))
        else:
            collectives.append(Collective("tensor-parallel activations", "all-reduce", "tp", calls, activation,
                                          calls * 2 * share * activation))
        tp_comm = sum(c.wire_bytes for c in collectives if c.group == "tp") / link
    bubble = 0.0
    pp_comm = 0.0
    if pp > 1:
        v = layout.stages_per_rank
        m = layout.microbatches
        bubble = compute * (pp - 1) / (m * v)  # (pp - 1) idle slots of a microbatch's share of one stage
        boundary = microbatch_tokens * shape.hidden * compute_bytes
        collectives.append(Collective("pipeline activations and their gradients", "send/recv", "pp", 2 * m * v,
                                      boundary, 2 * m * v * boundary))
        pp_comm = 2 * m * v * boundary / link
    step_bytes_per_param = 28 if layout.optimizer != "sgd" else 16  # read p, g, m, v; write p, m, v
    optimizer = local * (step_bytes_per_param + 12) / hw.memory_bandwidth  # + the gradient norm and clipping
    comm = dp_comm + tp_comm + pp_comm
    return StepEstimate(layout=layout, params_bytes=params_bytes, grads_bytes=grads_bytes,
                        optimizer_bytes=optimizer_bytes, gathered_bytes=gathered, activation_bytes=acts,
                        other_bytes=other, working_bytes=working, grads_in_forward=grads_in_forward,
                        collectives=collectives, compute_s=compute, comm_s=comm,
                        comm_exposed_s=dp_exposed + tp_comm + pp_comm, bubble_s=bubble, optimizer_s=optimizer,
                        tokens=tokens, memory_limit=USABLE_MEMORY * hw.memory_bytes)


def _factorizations(world: int) -> List[Tuple[int, int, int]]:
    return [(pp, dp, world // (pp * dp)) for pp in range(1, world + 1) if world % pp == 0
            for dp in range(1, world // pp + 1) if (world // pp) % dp == 0]


def candidate_layouts(shape: ModelShape, world: int, global_batch: int, base: Layout,
                      tp_sizes: Sequence[int], fixed: Optional[Dict] = None, max_bf16_reduce_ranks: int = 8
                      ) -> List[Layout]:
    """Every layout of ``world`` ranks that can run: ``tp`` among ``tp_sizes``, whole batches per dp rank and
    microbatch, at least one layer per stage. ``base`` gives precision, speed-ups and the pipeline schedule;
    ``fixed`` the choices the user made (``dp_mode``, ``reshard``, ``reduce_dtype``, ``activation_checkpoint``,
    ``sp``, ``optimize``, ``microbatches``) that every candidate keeps."""
    fixed = dict(fixed or {})
    out = []
    for pp, dp, tp in _factorizations(world):
        if tp not in tp_sizes or pp > shape.layers or (pp > 1 and fixed.get("optimize")):
            continue
        if fixed.get("sp") and tp < 2:
            continue
        v = 1
        if pp > 1 and base.pp_schedule in ("Interleaved1F1B", "ZeroBubble"):
            v = 2
        if pp * v > shape.layers:
            continue
        m = fixed.get("microbatches") or (pp * v if pp > 1 else 1)
        if global_batch % (dp * m):
            continue
        modes = [fixed["dp_mode"]] if fixed.get("dp_mode") else (["fsdp", "ddp"] if dp > 1 else ["fsdp"])
        for mode in modes:
            reshards = [True] if mode != "fsdp" or dp < 2 else (
                [False] if fixed.get("reshard") is False else [True, False])
            reduces = [fixed["reduce_dtype"]] if fixed.get("reduce_dtype") else (
                ["fp32", "bf16"] if dp > 1 and base.dtype == "bf16" and dp <= max_bf16_reduce_ranks else ["fp32"])
            checkpoints = [True] if fixed.get("activation_checkpoint") else [False, True]
            for reshard in reshards:
                for reduce in reduces:
                    for ckpt in checkpoints:
                        optimize = base.optimize and pp == 1
                        out.append(dataclasses.replace(
                            base, pp=pp, dp=dp, tp=tp, dp_mode=mode, reshard=reshard, reduce_dtype=reduce,
                            activation_checkpoint=ckpt, sp=bool(fixed.get("sp")), microbatches=m,
                            stages_per_rank=v, optimize=optimize))
    return out


@dataclasses.dataclass
class Choice:
    """The chosen layout's estimate, every candidate's (fastest first, those that fit first) and why."""

    best: StepEstimate
    ranked: List[StepEstimate]
    reason: str

    def runner_up(self) -> Optional[StepEstimate]:
        return next((e for e in self.ranked[1:] if e.fits), None)


def _rank_key(e: StepEstimate):
    # fitting layouts first, then the fastest; among equals the simpler (fewer pipeline and tensor ranks,
    # resharding kept, fp32 reduction, no recomputation)
    lay = e.layout
    return (not e.fits, round(e.step_s, 6) if e.fits else e.total_bytes, lay.pp, lay.tp, lay.dp_mode != "fsdp",
            not lay.reshard, lay.reduce_dtype != "fp32", lay.activation_checkpoint)


def choose_layout(shape: ModelShape, hw: Hardware, world: int, global_batch: int, seq: int,
                  base: Optional[Layout] = None, tp_sizes: Sequence[int] = (1,), fixed: Optional[Dict] = None,
                  candidates: Optional[List[Layout]] = None) -> Choice:
    """The fastest layout that fits the device's memory (by :func:`estimate_step`), and a short reason."""
    base = base or Layout()
    layouts = candidates if candidates is not None else candidate_layouts(shape, world, global_batch, base,
                                                                         tp_sizes, fixed)
    if not layouts:
        raise ValueError(f"no layout of {world} ranks fits global batch {global_batch} and the model "
                         f"({shape.layers} layers; tensor-parallel sizes {list(tp_sizes)})")
    ranked = sorted((estimate_step(shape, lay, hw, global_batch, seq) for lay in layouts), key=_rank_key)
    best = ranked[0]
    return Choice(best, ranked, _reason(best, ranked, hw))


def _same_except(a: Layout, b: Layout, **changes) -> bool:
    return dataclasses.replace(a, **changes) == b


def _alternative(best: StepEstimate, ranked: List[StepEstimate], **changes) -> Optional[StepEstimate]:
    target = dataclasses.replace(best.layout, **changes)
    return next((e for e in ranked if e.layout == target), None)


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:,.0f} ms"


def _reason(best: StepEstimate, ranked: List[StepEstimate], hw: Hardware) -> str:
    lay = best.layout
    parts = []
    mem = f"{best.total_bytes / GIB:.1f} of {hw.memory_bytes / GIB:.0f} GiB per rank"
    if not best.fits:
        parts.append(f"no layout fits the estimated memory: this one needs the least ({mem})")
    else:
        parts.append(mem)
    others = []
    seen = {(lay.pp, lay.dp, lay.tp)}
    for e in ranked[1:]:
        key = (e.layout.pp, e.layout.dp, e.layout.tp)
        if key not in seen and e.fits:
            seen.add(key)
            others.append(f"pp={key[0]} dp={key[1]} tp={key[2]} {_ms(e.step_s)}")
    if others:
        parts.append(f"est. {_ms(best.step_s)}/step against {', '.join(others[:3])}")
    if lay.dp > 1:
        ddp = _alternative(best, ranked, dp_mode="ddp" if lay.dp_mode == "fsdp" else "fsdp", reshard=True)
        if lay.dp_mode == "fsdp" and ddp is not None:
            why = "shards the optimizer step and state" if ddp.fits else "DDP does not fit"
            parts.append(f"FSDP2 {why} ({_ms(ddp.step_s - best.step_s)} less than DDP)" if ddp.fits
                         else f"FSDP2: {why}")
        if lay.dp_mode == "fsdp":
            if not lay.reshard:
                parts.append("no resharding: the gathered weights fit, one all-gather per layer instead of two")
            else:
                alt = _alternative(best, ranked, reshard=False)
                if alt is not None and not alt.fits:
                    parts.append("resharding after forward: keeping the gathered weights would not fit")
        if lay.reduce_dtype == "bf16":
            parts.append(f"bf16 gradient reduction: half the bytes over {lay.dp} ranks")
    if lay.activation_checkpoint:
        alt = _alternative(best, ranked, activation_checkpoint=False)
        if alt is not None and not alt.fits:
            parts.append(f"activation checkpointing: without it {alt.total_bytes / GIB:.1f} GiB would not fit")
    parts.append(f"interconnect {hw.link_bytes_per_s / 1e9:,.1f} GB/s ({hw.link_source})")
    return "; ".join(parts)


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def format_estimate(e: StepEstimate, hw: Hardware, header: str = "", extras: str = "") -> str:
    """The plan block: layout, memory per rank, the collectives of a step with their bytes, the step time."""
    lay = e.layout
    lines = [header] if header else []
    lines.append(f"  layout      {lay.describe()}{'; ' + extras if extras else ''}")
    forward = e.forward_peak_bytes >= e.backward_peak_bytes
    held = (f" + grads {_size(e.grads_bytes)}" if not forward or e.grads_in_forward else "")
    mem = (f"params {_size(e.params_bytes)} + optimizer {_size(e.optimizer_bytes)}"
           + (f" + gathered/cast weights {_size(e.gathered_bytes)}" if e.gathered_bytes else "")
           + held
           + (f" + activations {_size(e.activation_bytes)}" if forward else "")
           + f" + one layer's working set {_size(e.working_bytes)}"
           + (f" + workspace {_size(e.other_bytes)}" if e.other_bytes else ""))
    when = ("at the turn to the backward" + ("" if e.grads_in_forward else
                                             f"; grads {_size(e.grads_bytes)} come after the activations go")
            if forward else f"at the end of the backward; activations {_size(e.activation_bytes)} before it")
    lines.append(f"  per rank    {mem} = peak {_size(e.total_bytes)} of {_size(hw.memory_bytes)} ({when})"
                 + ("" if e.fits else "  (DOES NOT FIT)"))
    if e.collectives:
        for i, c in enumerate(e.collectives):
            lines.append(f"  {'per step' if i == 0 else '':<11} {c.op} over {c.group}: {c.what}, {c.count} x "
                         f"{_size(c.bytes_each)}, {_size(c.wire_bytes)} sent per rank")
    else:
        lines.append("  per step    no collectives")
    lines.append(f"  estimate    {_ms(e.step_s)}/step, {e.tokens_per_s:,.0f} tokens/s (compute {_ms(e.compute_s)}, "
                 f"exposed communication {_ms(e.comm_exposed_s)}"
                 + (f", pipeline bubble {_ms(e.bubble_s)}" if e.bubble_s else "")
                 + f", optimizer {_ms(e.optimizer_s)}); {hw.name}, link {hw.link_bytes_per_s / 1e9:,.1f} GB/s "
                 f"({hw.link_source})")
    return "\n".join(lines)

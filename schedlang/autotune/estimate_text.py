"""A step estimate as text (the plan block ``schedlang train --dry-run`` prints) and as JSON (``--json``)."""

from __future__ import annotations

from typing import Dict, List, Optional

from .step_cost import GIB, Hardware, StepEstimate

__all__ = ["format_estimate", "estimate_json", "layout_json"]


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:,.0f} ms"


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def format_estimate(e: StepEstimate, hw: Hardware, header: str = "", extras: str = "") -> str:
    """The plan block: layout, memory per rank, the collectives of a step with their bytes and links, the step
    time."""
    lay = e.layout
    lines = [header] if header else []
    lines.append(f"  layout      {lay.describe()}{'; ' + extras if extras else ''}")
    forward = e.forward_peak_bytes >= e.backward_peak_bytes
    grads = e.grads_bytes if not forward else e.turn_grads_bytes
    held = f" + grads {_size(grads)}" if grads else ""
    mem = (f"params {_size(e.params_bytes)} + optimizer {_size(e.optimizer_bytes)}"
           + (f" + gathered/cast weights {_size(e.gathered_bytes)}" if e.gathered_bytes else "")
           + held
           + (f" + activations {_size(e.activation_bytes)}" if forward
              else f" + a layer's backward {_size(e.working_bytes)}")
           + (f" + workspace {_size(e.other_bytes)}" if e.other_bytes else ""))
    # early in the backward, the larger of the loss's backward (the logits) and the first layer's
    layer = e.layer_backward_bytes
    early = (f"the loss's backward, logits {_size(e.logits_bytes)}" if e.logits_bytes > layer else
             f"a layer's backward {_size(layer)}" + (f" (recomputed {_size(e.recompute_bytes)})"
                                                     if e.recompute_bytes else ""))
    if not forward:
        when = f"at the end of the backward; activations {_size(e.activation_bytes)} before it"
    elif not e.grads_in_forward:
        when = f"early in the backward, at {early}; grads {_size(e.grads_bytes)} come after the activations go"
    elif e.freed_before_grads_bytes and not e.turn_grads_bytes:
        when = (f"at the first backward, which frees {_size(e.freed_before_grads_bytes)} of activations before "
                f"the grads {_size(e.grads_bytes)} are whole")
    elif e.freed_before_grads_bytes:
        when = (f"at the end of the first backward: it freed {_size(e.freed_before_grads_bytes)} of the "
                f"activations, the grads {_size(e.grads_bytes)} are whole")
    else:
        when = f"early in the backward, at {early}"
    lines.append(f"  per rank    {mem} = peak {_size(e.total_bytes)} of {_size(hw.memory_bytes)} ({when})"
                 + ("" if e.total_bytes <= e.memory_limit else "  (DOES NOT FIT)"))
    if e.build_bytes > e.total_bytes:
        lines.append(f"  build       {_size(e.build_bytes)} while building: the rank's stage in fp32 before data "
                     "parallelism shards it, and a full-size copy of the embedding for its init"
                     + ("" if e.build_bytes <= e.memory_limit else "  (DOES NOT FIT)"))
    if e.moe:
        lines.append(f"  experts     {moe_text(e.moe)}")
    if e.collectives:
        for i, c in enumerate(e.collectives):
            lines.append(f"  {'per step' if i == 0 else '':<11} {c.op} over {c.group}: {c.what}, {c.count} x "
                         f"{_size(c.bytes_each)}, {_size(c.wire_bytes)} sent per rank, {c.link} "
                         f"{_ms(c.seconds)}")
    else:
        lines.append("  per step    no collectives")
    lines.append(f"  estimate    {_ms(e.step_s)}/step, {e.tokens_per_s:,.0f} tokens/s (compute {_ms(e.compute_s)}, "
                 f"exposed communication {_ms(e.comm_exposed_s)}"
                 + (f", pipeline bubble {_ms(e.bubble_s)}" if e.bubble_s else "")
                 + f", optimizer {_ms(e.optimizer_s)}); {hw.name}, {hw.describe_links()}")
    return "\n".join(lines)


def moe_text(moe: Dict) -> str:
    """A mixture of experts' line of the plan: the experts, how many each rank holds, the imbalance assumed."""
    text = (f"{moe['experts']} routed experts, top-{moe['top_k']}, in {moe['moe_layers']} layer(s): flops count the "
            f"{moe['active_expert_params'] / 1e6:,.0f}M of {moe['expert_params'] / 1e6:,.0f}M expert parameters a "
            f"token uses; ep={moe['ep']}: {moe['experts_per_rank']} expert(s) per rank")
    if moe["ep"] > 1:
        text += (f"; assumes the busiest expert-parallel rank receives {moe['load_imbalance']:.2f}x the mean tokens "
                 "(its expert compute, activations and all-to-all bytes scaled by it)")
    return text


def layout_json(e: StepEstimate) -> Dict:
    """The layout's degrees as integers and its options, as ``--json`` writes them."""
    lay = e.layout
    rows = e.global_batch // max(1, lay.dp * lay.microbatches) if e.global_batch else None
    return {"pp": lay.pp, "dp_replicate": lay.replicas, "dp_shard": lay.dp_shard, "tp": lay.tp, "cp": lay.cp, "ep": lay.ep,
            "dp": lay.dp, "dp_mode": lay.dp_mode, "sp": lay.sp, "microbatches": lay.microbatches,
            "accumulation_steps": lay.microbatches if lay.pp == 1 else 1, "local_batch": rows,
            "stages_per_rank": lay.stages_per_rank, "pp_schedule": lay.pp_schedule if lay.pp > 1 else None,
            "activation_checkpoint": lay.activation_checkpoint, "reshard": lay.reshard,
            "reduce_dtype": lay.reduce_dtype, "float8": lay.float8, "dtype": lay.dtype,
            "describe": lay.describe()}


def _estimate_summary(e: StepEstimate) -> Dict:
    return {"layout": layout_json(e), "peak_gib": e.total_bytes / GIB, "build_peak_gib": e.build_bytes / GIB,
            "fits": e.fits, "step_ms": 1e3 * e.step_s,
            "tokens_per_s": e.tokens_per_s}


def estimate_json(e: StepEstimate, hw: Hardware, runners_up: Optional[List] = None,
                  extra: Optional[Dict] = None) -> Dict:
    """The plan as one JSON object: the layout, the largest rank's peak memory, step time, throughput, the
    collectives with bytes and link, the memory terms and the runners-up (``RunnerUp`` objects)."""
    out = _estimate_summary(e)
    out.update(
        memory_gib={k: getattr(e, k) / GIB for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                     "gathered_bytes", "activation_bytes", "logits_bytes",
                                                     "working_bytes", "other_bytes")},
        usable_gib=e.memory_limit / GIB,
        time_ms={"compute": 1e3 * e.compute_s, "exposed_communication": 1e3 * e.comm_exposed_s,
                 "bubble": 1e3 * e.bubble_s, "optimizer": 1e3 * e.optimizer_s},
        collectives=[{"what": c.what, "op": c.op, "group": c.group, "count": c.count, "bytes_each": c.bytes_each,
                      "wire_bytes": c.wire_bytes, "link": c.link, "ms": 1e3 * c.seconds} for c in e.collectives],
        cluster={"nodes": hw.nodes, "gpus_per_node": hw.gpus_per_node, "device": hw.name,
                 "memory_gib": hw.memory_bytes / GIB, "intra_node_gbps": hw.link_bytes_per_s / 1e9,
                 "inter_node_gbps": hw.network_bytes_per_s / 1e9, "intra_node_source": hw.link_source,
                 "inter_node_source": hw.inter_source},
        global_batch=e.global_batch, seq=e.seq, moe=e.moe,
        runners_up=[dict(_estimate_summary(r.estimate), why=r.why) for r in (runners_up or [])])
    if extra:
        out.update(extra)
    return out

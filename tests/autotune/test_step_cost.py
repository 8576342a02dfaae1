"""The step estimate: sequence parallelism splits what checkpointing keeps, each collective is charged on the
link it crosses, collective counts follow the microbatches, selective checkpointing sits between none and full,
float8 speeds up the layers' matmuls only."""

import dataclasses

import pytest

from schedlang.autotune.training_cost import (GIB, Hardware, Layout, estimate_step, saved_bytes_per_token,
                                              selective_recompute_share)

from .shapes import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B

HW64 = Hardware.nominal("cuda", "NVIDIA H100", memory_gib=80, world=64)
TP8 = Layout(dp=8, tp=8, activation_checkpoint="full", compiled=True, optimize=True)


def _early_backward(e):
    """The larger of the two moments early in the backward: the loss's (the logits) and a checkpointed layer's."""
    return max(e.logits_bytes, e.layer_backward_bytes)


def _relayed(shape, seq):
    """What a stage sends beside the hidden states per microbatch: the rotary cos and sin (bf16) and the position
    ids (float64), one row."""
    return seq * (2 * shape.head_dim * 2 + 8)


def _by(e, group, op):
    return next(c for c in e.collectives if c.group == group and c.op == op)


def test_sequence_parallelism_splits_the_saved_layer_inputs_over_the_tp_ranks():
    """70B on 8 x 8 GPUs, 64 x 8192 tokens, tp=8 with full checkpointing: each layer keeps its input, which SP
    splits along the sequence 8 ways; without SP every tp rank keeps the whole of it."""
    sp = dataclasses.replace(TP8, sp=True)
    assert saved_bytes_per_token(LLAMA3_70B, TP8) == 8192 * 2  # bf16 under FSDP2
    assert saved_bytes_per_token(LLAMA3_70B, sp) == 8192 * 2 / 8
    plain, split = (estimate_step(LLAMA3_70B, lay, HW64, 64, 8192) for lay in (TP8, sp))
    tokens = 64 / 8 * 8192
    kept = tokens * 80 * 8192 * 2
    # besides what the layers keep: the larger of the loss's backward and a recomputed layer's
    assert plain.activation_bytes - split.activation_bytes == pytest.approx(
        kept * 7 / 8 + _early_backward(plain) - _early_backward(split))
    assert split.fits and split.total_bytes < 60 * GIB  # the layout torchtitan runs fits an 80 GiB H100
    assert not plain.fits


def test_each_collective_is_charged_on_the_link_it_crosses():
    slow_network = dataclasses.replace(HW64, inter_bytes_per_s=HW64.network_bytes_per_s / 2)
    a, b = (estimate_step(LLAMA3_70B, dataclasses.replace(TP8, sp=True), hw, 64, 8192) for hw in (HW64, slow_network))
    for c in a.collectives:
        assert c.link == ("intra-node" if c.group == "tp" else "inter-node"), c
        other = next(d for d in b.collectives if (d.group, d.op) == (c.group, c.op))
        ratio = 1.0 if c.group == "tp" else 2.0
        assert other.seconds == pytest.approx(ratio * c.seconds)
        assert c.seconds == pytest.approx(c.wire_bytes / (HW64.link_bytes_per_s if c.group == "tp"
                                                          else HW64.network_bytes_per_s))
    # data parallelism inside one node (tp=1, 8 ranks) runs on NVLink
    one_node = estimate_step(LLAMA3_8B, Layout(dp=8), Hardware.nominal("cuda", world=8), 8, 2048)
    assert {c.link for c in one_node.collectives} == {"intra-node"}


@pytest.mark.parametrize("reshard, gathers", [(True, 2), (False, 1)])
def test_fsdp_and_tp_collectives_repeat_per_microbatch(reshard, gathers):
    base = dataclasses.replace(TP8, sp=True, reshard=reshard)
    one = estimate_step(LLAMA3_70B, base, HW64, 64, 8192)
    four = estimate_step(LLAMA3_70B, dataclasses.replace(base, microbatches=4), HW64, 64, 8192)
    layers = LLAMA3_70B.layers
    assert _by(one, "dp", "all-gather").count == gathers * layers
    assert _by(four, "dp", "all-gather").count == 4 * gathers * layers
    assert _by(four, "dp", "reduce-scatter").count == 4 * layers
    assert _by(four, "dp", "all-gather").wire_bytes == pytest.approx(4 * _by(one, "dp", "all-gather").wire_bytes)
    # tensor parallelism: four times the calls of a quarter of the activations: the same bytes per step
    assert _by(four, "tp", "all-gather").count == 4 * _by(one, "tp", "all-gather").count
    assert _by(four, "tp", "all-gather").bytes_each == pytest.approx(_by(one, "tp", "all-gather").bytes_each / 4)
    assert _by(four, "tp", "all-gather").wire_bytes == pytest.approx(_by(one, "tp", "all-gather").wire_bytes)
    assert four.grads_in_forward and not one.grads_in_forward


def test_replicas_sum_their_gradients_once_per_step():
    """DDP all-reduces the gradients once per step, HSDP its gradient shards over the replicas once per layer
    and step: neither repeats with accumulation. HSDP shards inside a node: its gathers stay on NVLink."""
    hw = Hardware.nominal("cuda", "NVIDIA H100", world=16)
    ddp = [estimate_step(LLAMA3_8B, Layout(dp=16, dp_mode="ddp", microbatches=m), hw, 32, 2048) for m in (1, 4)]
    assert [c.count for e in ddp for c in e.collectives] == [1, 1]
    assert ddp[0].collectives[0].link == "inter-node"
    hsdp = [estimate_step(LLAMA3_8B, Layout(dp=16, dp_mode="hsdp", dp_replicate=2, microbatches=m), hw, 32, 2048)
            for m in (1, 4)]
    for e, m in zip(hsdp, (1, 4)):
        assert e.layout.dp_shard == 8 and e.layout.mesh_sizes()["dp_replicate"] == 2
        assert _by(e, "dp_shard", "all-gather").count == 2 * m * 32 and _by(e, "dp_shard", "all-gather").link == \
            "intra-node"
        assert _by(e, "dp_replicate", "all-reduce").count == 32
        assert _by(e, "dp_replicate", "all-reduce").link == "inter-node"
    # the state is sharded 8 ways, not 16
    fsdp = estimate_step(LLAMA3_8B, Layout(dp=16), hw, 32, 2048)
    assert hsdp[0].optimizer_bytes == pytest.approx(2 * fsdp.optimizer_bytes)


def test_selective_checkpointing_sits_between_none_and_full():
    layouts = {mode: Layout(dp=8, activation_checkpoint=mode) for mode in ("none", "selective", "full")}
    e = {mode: estimate_step(LLAMA3_8B, lay, Hardware.nominal("cuda", world=8), 16, 8192)
         for mode, lay in layouts.items()}
    assert e["none"].activation_bytes > e["selective"].activation_bytes > e["full"].activation_bytes
    assert e["none"].compute_s < e["selective"].compute_s < e["full"].compute_s
    # LLaMA-3-8B: q, v, gate and down are kept (every other matmul, in call order), k, o and up recomputed
    h, kv, i = 4096, 1024, 14336
    assert selective_recompute_share(LLAMA3_8B) == pytest.approx((h * kv + h * h + h * i) /
                                                                 (2 * h * h + 2 * h * kv + 3 * h * i))
    kept = 2 * (h + (h + kv + i + h) + h) + 4 * 32  # input; q, v, gate, down; attention's output; log-sum-exp
    assert saved_bytes_per_token(LLAMA3_8B, layouts["selective"]) == kept


def test_float8_halves_only_the_layers_matmul_time():
    hw = Hardware.nominal("cuda", "NVIDIA H100", world=8)
    bf16, fp8 = (estimate_step(LLAMA3_8B, Layout(dp=8, float8=f), hw, 16, 8192) for f in (False, True))
    layers_gemm = 6 * 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert bf16.compute_s - fp8.compute_s == pytest.approx(bf16.compute_s * (layers_gemm / 2) / (
        6 * LLAMA3_8B.flops_params + 12 * 32 * 4096 * 8192))
    assert fp8.gathered_bytes > bf16.gathered_bytes  # a layer's float8 weight copies
    # a CPU rank has no float8 tensor cores: no speed-up
    cpu = Hardware.nominal("cpu", world=8)
    assert estimate_step(LLAMA3_8B, Layout(dp=8, float8=True), cpu, 16, 8192).compute_s == pytest.approx(
        estimate_step(LLAMA3_8B, Layout(dp=8), cpu, 16, 8192).compute_s)


def _torch_interleaved_peak(pp: int, v: int, m: int, rank: int) -> int:
    """Stage-microbatches rank ``rank`` holds at most in torch's own Interleaved 1F1B order (forwards run, not yet
    differentiated), read from the schedule's op list without building stages."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, v, m
    schedule.number_of_rounds = max(1, m // pp)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    held = peak = 0
    for action in schedule._calculate_single_rank_operations(rank):
        if action is None:
            continue
        if action.computation_type == _ComputationType.FORWARD:
            held += 1
        elif action.computation_type in (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT):
            held -= 1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("pp,v,m", [(8, 2, 16), (8, 2, 32), (4, 2, 8), (4, 3, 4), (4, 2, 2), (2, 2, 2)])
def test_interleaved_microbatches_in_flight_follow_torchs_schedule(pp, v, m):
    from schedlang.autotune.step_cost import _layers_in_flight

    layout = Layout(pp=pp, stages_per_rank=v, microbatches=m, pp_schedule="Interleaved1F1B")
    for rank in range(pp):
        # with v layers per rank, one per stage: the layer-microbatches are the stage-microbatches
        assert _layers_in_flight(layout, v, pp_rank=rank) == _torch_interleaved_peak(pp, v, m, rank), rank


def test_1f1b_and_gpipe_microbatches_in_flight():
    """torch's Schedule1F1B runs min(m, pp - rank) forwards before rank's first backward; GPipe all of them."""
    from schedlang.autotune.step_cost import _layers_in_flight

    assert [_layers_in_flight(Layout(pp=4, microbatches=8), 1, pp_rank=r) for r in range(4)] == [4, 3, 2, 1]
    assert [_layers_in_flight(Layout(pp=4, microbatches=2), 1, pp_rank=r) for r in range(4)] == [2, 2, 2, 1]
    assert _layers_in_flight(Layout(pp=4, microbatches=8, pp_schedule="GPipe"), 3, pp_rank=3) == 24


def test_a_pipeline_counts_the_logits_on_its_last_rank_only():
    """The first rank keeps the most microbatches and no logits; the last keeps one microbatch and the logits.
    The peak is the larger of the two ranks' activations, with the logits reported only where they are in it."""
    tokens = 8192  # one row of 8192 per microbatch
    deep = Layout(pp=4, microbatches=8, activation_checkpoint="full", compiled=True)  # 20 layers per rank
    e = estimate_step(LLAMA3_70B, deep, HW64, 8, 8192)
    layer_input = saved_bytes_per_token(LLAMA3_70B, deep)
    # the bf16 logits, the log-softmax's fp32 output, its gradient and the gradient of the logits' fp32 copy
    logits = tokens * LLAMA3_70B.vocab * (2 + 12)
    # the first rank also keeps each in-flight microbatch's output (fp32 residual stream: no FSDP here, with the
    # relayed rotary embeddings and positions) and one gradient receive buffer per microbatch; the last rank sends
    # nothing on, and keeps one receive buffer per microbatch for its input
    boundary = tokens * LLAMA3_70B.hidden * 4 + _relayed(LLAMA3_70B, 8192)
    first = tokens * 4 * 20 * layer_input + (4 + 8) * boundary
    last = tokens * 1 * 20 * layer_input + 8 * boundary + logits
    assert first > last  # the first rank's 4 microbatches win
    assert e.logits_bytes == 0
    assert e.activation_bytes == pytest.approx(first + e.layer_backward_bytes)  # with a recomputed layer's backward
    wide = dataclasses.replace(LLAMA3_70B, vocab=4 * LLAMA3_70B.vocab)  # a vocabulary large enough to tip it
    e = estimate_step(wide, deep, HW64, 8, 8192)
    logits = tokens * wide.vocab * (2 + 12)
    first = tokens * 4 * 20 * layer_input + (4 + 8) * boundary
    last = tokens * 1 * 20 * layer_input + 8 * boundary + logits
    assert first < last
    assert e.logits_bytes == pytest.approx(logits)
    assert e.activation_bytes == pytest.approx(last)  # the loss's backward, larger than a layer's


def test_a_rank_that_runs_every_forward_first_has_no_gradients_at_its_first_backward():
    """Zeroed after the last step, a pipeline's gradients come with a rank's first backward. Where 1F1B runs
    every microbatch's forward before it (m <= pp - rank) they are whole only once that backward has freed its
    microbatch: the peak is the larger of its start (every microbatch, no gradients) and its end (one microbatch
    fewer, every gradient). With more microbatches, the steady phase's forwards refill what it freed: all count."""
    tokens = 8192
    for m, freed_expected in ((4, True), (8, False)):
        layout = Layout(pp=4, microbatches=m, activation_checkpoint="full", compiled=True)
        e = estimate_step(LLAMA3_70B, layout, HW64, m, 8192)
        one_microbatch = (tokens * 20 * saved_bytes_per_token(LLAMA3_70B, layout) + tokens * LLAMA3_70B.hidden * 4
                          + _relayed(LLAMA3_70B, 8192))
        if freed_expected:
            assert e.freed_before_grads_bytes == pytest.approx(one_microbatch)
            assert e.turn_grads_bytes == pytest.approx(max(0.0, e.grads_bytes - one_microbatch))
        else:
            assert e.freed_before_grads_bytes == 0 and e.turn_grads_bytes == e.grads_bytes
        assert e.forward_peak_bytes == pytest.approx(e.gathered_bytes + max(
            e.activation_bytes, e.activation_bytes - e.freed_before_grads_bytes + e.grads_bytes))
    # GPipe runs every forward first whatever the count; gradient accumulation without a pipeline never does
    gpipe = estimate_step(LLAMA3_70B, Layout(pp=4, microbatches=8, pp_schedule="GPipe"), HW64, 8, 8192)
    accumulated = estimate_step(LLAMA3_70B, Layout(dp=8, microbatches=4), HW64, 64, 8192)
    assert gpipe.freed_before_grads_bytes > 0
    assert accumulated.freed_before_grads_bytes == 0 and accumulated.turn_grads_bytes == accumulated.grads_bytes


def test_405b_1f1b_with_one_microbatch_per_stage_peaks_above_interleaved():
    """torchtitan's published LLaMA-3.1-405B runs (FSDP 8 x TP 8 x PP 8, local batch 32, full AC) split the rows
    into one microbatch per stage by default: 8 of 4 rows under 1F1B, 16 of 2 rows under Interleaved 1F1B (v=2);
    1F1B's first rank then keeps 8 x 16 layer inputs of 4 rows, more than interleaved's 23 x 8 of 2 rows."""
    from .shapes import LLAMA3_405B

    hw = Hardware.nominal("cuda", "NVIDIA H100", memory_gib=80, world=512)
    base = Layout(pp=8, dp=8, tp=8, sp=True, activation_checkpoint="full", compiled=True)
    one = estimate_step(LLAMA3_405B, dataclasses.replace(base, microbatches=8), hw, 256, 8192)
    inter = estimate_step(LLAMA3_405B, dataclasses.replace(base, microbatches=16, stages_per_rank=2,
                                                            pp_schedule="Interleaved1F1B"), hw, 256, 8192)
    assert one.total_bytes > inter.total_bytes
    layer_input = saved_bytes_per_token(LLAMA3_405B, base)
    # a stage's output is a layer's input in size with the relayed rotary embeddings and positions: one per
    # stage-microbatch in flight, one receive buffer for its gradient per stage-microbatch of the step, and under
    # interleaving, one receive buffer per microbatch for the input of the rank's second stage
    relayed = _relayed(LLAMA3_405B, 8192)
    assert one.activation_bytes - _early_backward(one) == pytest.approx(
        8 * 16 * 4 * 8192 * layer_input + (8 + 8) * (4 * 8192 * layer_input + relayed))
    assert inter.activation_bytes - _early_backward(inter) == pytest.approx(
        23 * 8 * 2 * 8192 * layer_input + (23 + 32 + 16) * (2 * 8192 * layer_input + relayed))
    # 1F1B's first rank runs all 8 forwards before its first backward: the gradients are whole once it has freed
    # one microbatch (16 layer inputs and its output); interleaved's steady phase refills what it frees
    assert one.freed_before_grads_bytes == pytest.approx(16 * 4 * 8192 * layer_input + 4 * 8192 * layer_input
                                                         + relayed)
    assert inter.freed_before_grads_bytes == 0


def test_a_compiled_layer_under_selective_checkpointing_keeps_no_row_parallel_output():
    """The compiler saves what a backward reads: o's and down's outputs feed only the residual add, so a compiled
    layer keeps q, v and gate of the policy's q, v, gate and down (eager checkpointing's cache keeps all four)."""
    h, kv, i = 4096, 1024, 14336
    compiled = Layout(dp=8, activation_checkpoint="selective", compiled=True, optimize=True)
    assert saved_bytes_per_token(LLAMA3_8B, compiled) == 2 * (h + (h + kv + i) + h) + 4 * 32


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_costs_its_forward_flops_at_a_forward_gemms_rate(mode):
    """Full: every layer's forward but its last matmul (down), with attention's causal forward; selective: the
    policy's recomputed matmuls (k, o, up). Both run at a plain forward GEMM's rate (0.7 of the peak)."""
    hw = Hardware.nominal("cuda", "NVIDIA H100", world=8)
    h, kv, i, layers, seq, tokens = 4096, 1024, 14336, 32, 8192, 16 * 8192
    none, checkpointed = (estimate_step(LLAMA3_8B, Layout(dp=8, activation_checkpoint=m, compiled=True,
                                                          optimize=True), hw, 16, seq) for m in ("none", mode))
    if mode == "full":
        flops = 2 * layers * (2 * h * h + 2 * h * kv + 2 * h * i) + 2 * layers * h * seq
    else:
        flops = 2 * layers * (h * kv + h * h + h * i)
    assert checkpointed.compute_s - none.compute_s == pytest.approx(tokens * flops / (8 * hw.peak_flops * 0.7))


def test_the_loss_and_a_recomputed_layer_are_in_flight_one_after_the_other():
    """Early in the backward the loss's backward frees the logits before the last layer is recomputed: the peak
    counts the larger of the two, not both. Without checkpointing nothing is recomputed."""
    hw = Hardware.nominal("cuda", "NVIDIA H100", memory_gib=80, world=8)
    for mode in ("none", "selective", "full"):
        layout = Layout(dp=8, activation_checkpoint=mode)  # eager: the logits are there
        e = estimate_step(LLAMA3_8B, layout, hw, 16, 4096)
        tokens = 2 * 4096
        saved = tokens * LLAMA3_8B.layers * saved_bytes_per_token(LLAMA3_8B, layout)
        assert e.logits_bytes == pytest.approx(tokens * LLAMA3_8B.vocab * (2 + 12))
        assert (e.recompute_bytes == 0) == (mode == "none")
        assert e.activation_bytes == pytest.approx(saved + max(e.logits_bytes, e.recompute_bytes + e.working_bytes))
    # full checkpointing recomputes more of a layer than selective does
    sel, full = (estimate_step(LLAMA3_8B, Layout(dp=8, activation_checkpoint=m), hw, 16, 4096)
                 for m in ("selective", "full"))
    assert full.recompute_bytes > sel.recompute_bytes > 0


def test_a_compiled_checkpointed_layer_holds_no_bf16_weight_copies_of_the_other_layers():
    """Without FSDP, bf16 autocast casts each fp32 weight for its matmul. Eager autocast caches every cast until the
    forward ends, and a layer without checkpointing saves its casts for its backward: all of them are held. A
    compiled checkpointed layer casts inside its graph and saves only its input: the output head's copy and the
    recomputed layer's are held."""
    hw = Hardware.nominal("cuda", "NVIDIA H100", memory_gib=80, world=1)
    shape = LLAMA3_8B
    stage = shape.params  # one rank holds the whole model
    layer = (stage - shape.embedding_params) / shape.layers
    plain = estimate_step(shape, Layout(compiled=True), hw, 1, 4096)
    eager_full = estimate_step(shape, Layout(activation_checkpoint="full"), hw, 1, 4096)
    compiled_full = estimate_step(shape, Layout(activation_checkpoint="full", compiled=True), hw, 1, 4096)
    assert plain.gathered_bytes == pytest.approx(2 * stage) and eager_full.gathered_bytes == pytest.approx(2 * stage)
    assert compiled_full.gathered_bytes == pytest.approx(2 * (shape.vocab * shape.hidden + layer))


def test_the_build_holds_the_rank_s_stage_in_fp32_before_data_parallelism_shards_it():
    """Built from the meta device, a rank allocates its stage (tensor-parallel shards; a pipeline rank its own
    stages only) in fp32 and FSDP2 shards it afterwards, each module initialized on a full-size copy: the
    embedding, whole, is the largest. 70B at tp 8 builds within the step's peak; 405B without a pipeline cannot
    build on an 80 GiB GPU (202 GB of shards a rank), with pp 8 it can."""
    hw = Hardware.nominal("cuda", "NVIDIA H100", memory_gib=80, world=512)
    embedding = 4 * LLAMA3_70B.vocab * LLAMA3_70B.hidden
    e = estimate_step(LLAMA3_70B, dataclasses.replace(TP8, sp=True), HW64, 64, 8192)
    assert e.build_bytes == pytest.approx(4 * LLAMA3_70B.params / 8 + embedding + 0.5 * GIB, rel=1e-9)
    assert e.build_bytes < e.total_bytes == e.peak_bytes and e.fits
    flat = estimate_step(LLAMA3_405B, Layout(dp=64, tp=8, sp=True, activation_checkpoint="full", compiled=True,
                                              optimize=True), hw, 512, 8192)
    assert flat.total_bytes < flat.memory_limit < flat.build_bytes == flat.peak_bytes
    assert not flat.fits
    staged = estimate_step(LLAMA3_405B, Layout(pp=8, dp=8, tp=8, sp=True, activation_checkpoint="full",
                                                microbatches=8, compiled=True, optimize=True), hw, 512, 8192)
    whole = 4 * LLAMA3_405B.vocab * LLAMA3_405B.hidden + 0.5 * GIB  # the embedding's copy, the workspace
    # a rank's own stages: an eighth of the shards (the largest stage, 16 of 126 layers, and the embedding)
    assert staged.build_bytes - whole == pytest.approx((flat.build_bytes - whole) / 8, rel=0.05)
    assert staged.build_bytes < staged.memory_limit

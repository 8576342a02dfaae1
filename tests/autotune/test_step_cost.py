"""The step estimate: sequence parallelism splits what checkpointing keeps, each collective is charged on the
link it crosses, collective counts follow the microbatches, selective checkpointing sits between none and full,
float8 speeds up the layers' matmuls only."""

import dataclasses

import pytest

from schedlang.autotune.training_cost import (GIB, Hardware, Layout, estimate_step, saved_bytes_per_token,
                                              selective_recompute_share)

from .shapes import LLAMA3_8B, LLAMA3_70B

HW64 = Hardware.nominal("cuda", "NVIDIA H100", memory_gib=80, world=64)
TP8 = Layout(dp=8, tp=8, activation_checkpoint="full", compiled=True, optimize=True)


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
    assert plain.activation_bytes - split.activation_bytes == pytest.approx(kept * 7 / 8 + tokens * (
        plain.working_bytes - split.working_bytes) / tokens)
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

"""Mixture-of-experts models and expert parallelism in the step estimate, and context / expert parallelism in the
search: parameter and flop counts against a hand count of models built from their configs, the experts' memory
per rank against ep, the all-to-all's bytes and link, and the layouts ``--layout auto`` picks."""

import dataclasses
import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from schedlang.autotune.layout_search import LONG_SEQUENCE
from schedlang.autotune.moe_cost import LOAD_IMBALANCE, count_expert_params, moe_layer_indices, moe_shape
from schedlang.autotune.training_cost import GIB, Hardware, Layout, choose_layout, estimate_step, format_estimate

from .shapes import LLAMA3_8B, LLAMA3_405B, QWEN3_30B_A3B

FAST = Layout(dtype="bf16", optimize=True, compiled=True, optimizer="fused-adamw")
TP = [1, 2, 4, 8]


def _meta(family, **kw):
    cfg = AutoConfig.for_model(family, **kw)
    with torch.device("meta"):
        return cfg, AutoModelForCausalLM.from_config(cfg)


def _layers_with_experts(model):
    return sorted({int(n.split(".")[2]) for n, _ in model.named_parameters() if ".experts." in n})


def test_mixtral_experts_counted_exactly_and_flops_use_the_top_k():
    h, inter, layers, experts, k = 48, 80, 3, 6, 2
    cfg, model = _meta("mixtral", hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                       num_experts_per_tok=k, vocab_size=101)
    moe = moe_shape(cfg, layers, count_expert_params(model))
    hand = layers * experts * (2 * inter * h + h * inter)  # gate_up and down per expert and layer
    assert count_expert_params(model) == hand == moe.expert_params
    assert moe_shape(cfg, layers).expert_params == hand  # the analytic count agrees
    assert (moe.experts, moe.top_k, moe.expert_intermediate, moe.moe_layers, moe.shared_intermediate) == (
        experts, k, inter, layers, 0)
    assert moe.active_expert_params == hand * k / experts
    assert moe_layer_indices(cfg, layers) == _layers_with_experts(model) == [0, 1, 2]


def test_qwen3_moe_dense_layers_and_deepseek_shared_experts_are_read_from_the_config():
    cfg, model = _meta("qwen3_moe", hidden_size=32, intermediate_size=72, moe_intermediate_size=24,
                       num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       num_experts=8, num_experts_per_tok=3, vocab_size=97, decoder_sparse_step=1,
                       mlp_only_layers=[1, 3])
    moe = moe_shape(cfg, 5, count_expert_params(model))
    assert moe_layer_indices(cfg, 5) == _layers_with_experts(model) == [0, 2, 4]
    assert moe.expert_params == 3 * 8 * 3 * 32 * 24 and moe.top_k == 3 and moe.expert_intermediate == 24
    cfg, model = _meta("deepseek_v3", hidden_size=32, intermediate_size=72, moe_intermediate_size=16,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                       num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1, vocab_size=97,
                       q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                       n_group=2, topk_group=1)
    moe = moe_shape(cfg, 4, count_expert_params(model))
    assert moe_layer_indices(cfg, 4) == _layers_with_experts(model) == [1, 2, 3]
    # the shared experts are dense parameters: not under the routed experts' count
    shared = sum(p.numel() for n, p in model.named_parameters() if ".shared_experts." in n)
    assert shared == 3 * 3 * 32 * 16 * 2 and moe.expert_params == 3 * 8 * 3 * 32 * 16
    assert moe.shared_intermediate == 2 * 16
    assert moe_shape(AutoConfig.for_model("llama", num_hidden_layers=2), 2) is None


def test_the_dry_run_counts_a_mixtral_tokens_active_parameters(tmp_path):
    import argparse

    from schedlang.train.layout import model_facts

    h, inter, layers, experts, k, vocab = 64, 96, 2, 4, 2, 100
    cfg = AutoConfig.for_model("mixtral", hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                               num_experts_per_tok=k, vocab_size=vocab)
    cfg.save_pretrained(tmp_path)
    facts = model_facts(argparse.Namespace(model=None, config=str(tmp_path)))
    attention = 2 * h * h + 2 * h * (h // 2)  # q, o; k, v of 2 kv heads
    dense = layers * (attention + experts * h + 2 * h) + h  # the router, two norms per layer; the final norm
    routed = layers * experts * 3 * h * inter
    assert facts.n_params == dense + routed + 2 * vocab * h
    assert facts.shape.flops_params == dense + routed * k // experts + vocab * h  # the head, not the lookup
    assert facts.shape.moe.expert_params == routed


HW64 = Hardware.nominal("cuda", "NVIDIA H100", memory_gib=80, world=64, gpus_per_node=8)


def test_expert_memory_per_rank_falls_with_ep():
    """DDP keeps every weight it holds: 1/ep of the experts. FSDP shards everything already; ep shrinks what a
    layer gathers (its experts' 1/ep) and the experts' all-gather bytes."""
    experts_bytes = QWEN3_30B_A3B.moe.expert_params * (4 + 4 + 8)  # weight, gradient, Adam's two moments
    ddp = [estimate_step(QWEN3_30B_A3B, Layout(dp=64, dp_mode="ddp", ep=ep), HW64, 64, 4096) for ep in (1, 8, 64)]
    held = [e.params_bytes + e.grads_bytes + e.optimizer_bytes for e in ddp]
    assert held[0] - held[1] == pytest.approx(experts_bytes * (1 - 1 / 8) + QWEN3_30B_A3B.moe.expert_params * 4
                                              * (1 - 1 / 8), rel=1e-9)  # and DDP's fp32 gradient buckets
    assert held[0] > held[1] > held[2]
    fsdp = [estimate_step(QWEN3_30B_A3B, Layout(dp=64, ep=ep), HW64, 64, 4096) for ep in (1, 8)]
    assert fsdp[1].params_bytes == pytest.approx(fsdp[0].params_bytes, rel=1e-9)  # fully sharded either way
    per_layer_experts = QWEN3_30B_A3B.moe.expert_params / 48 * 2  # bf16
    assert fsdp[0].gathered_bytes - fsdp[1].gathered_bytes == pytest.approx(2 * per_layer_experts * 7 / 8, rel=1e-6)
    gather = [sum(c.wire_bytes for c in e.collectives if c.op == "all-gather") for e in fsdp]
    assert gather[1] < gather[0] / 4


def test_the_all_to_all_bytes_and_the_link_it_crosses():
    moe = QWEN3_30B_A3B.moe
    for ep, tp, link in ((8, 1, "intra-node"), (4, 2, "intra-node"), (16, 1, "inter-node"), (4, 4, "inter-node")):
        lay = Layout(dp=64 // tp, tp=tp, ep=ep, microbatches=2, activation_checkpoint="full")
        e = estimate_step(QWEN3_30B_A3B, lay, HW64, 128, 4096)
        a2a = [c for c in e.collectives if c.op == "all-to-all"]
        assert len(a2a) == 1 and a2a[0].group == "ep" and a2a[0].link == link, (ep, tp)
        tokens = 128 / (64 // tp) / 2 * 4096
        assert a2a[0].count == 6 * 48 * 2  # dispatch, combine; their gradients; again in the recomputation
        assert a2a[0].bytes_each == pytest.approx(tokens * moe.top_k * 2048 * 2 * LOAD_IMBALANCE)
        assert a2a[0].wire_bytes == pytest.approx(a2a[0].count * (ep - 1) / ep * a2a[0].bytes_each)
    plain = estimate_step(QWEN3_30B_A3B, Layout(dp=64), HW64, 128, 4096)
    assert not any(c.op == "all-to-all" for c in plain.collectives)
    # a dense model has no experts to spread: ep changes nothing
    dense = [estimate_step(LLAMA3_8B, Layout(dp=8, ep=ep), HW64, 8, 4096) for ep in (1, 8)]
    assert dense[0].step_s == dense[1].step_s and dense[0].total_bytes == dense[1].total_bytes


def test_the_flops_of_a_moe_step_are_its_active_parameters_and_the_imbalance():
    one, eight = (estimate_step(QWEN3_30B_A3B, Layout(dp=64, ep=ep), HW64, 64, 4096) for ep in (1, 8))
    dense_like = dataclasses.replace(QWEN3_30B_A3B, moe=None, intermediate=8 * 768)
    # a MoE layer's matmuls are a dense MLP's of top_k x the expert width, as far as a token is concerned
    assert one.compute_s == pytest.approx(estimate_step(dense_like, Layout(dp=64), HW64, 64, 4096).compute_s)
    extra = 64 * 4096 * 6 * QWEN3_30B_A3B.moe.active_expert_params * (LOAD_IMBALANCE - 1)
    assert eight.compute_s - one.compute_s == pytest.approx(extra / (64 * HW64.peak_flops * 0.33), rel=1e-6)
    text = format_estimate(eight, HW64)
    assert "ep=8: 16 expert(s) per rank" in text and f"{LOAD_IMBALANCE:.2f}x the mean tokens" in text
    assert eight.as_dict()["moe"]["load_imbalance"] == LOAD_IMBALANCE


def test_layout_auto_picks_expert_parallelism_for_a_qwen3_30b_a3b_on_64_gpus():
    choice = choose_layout(QWEN3_30B_A3B, HW64, 64, 128, 8192, base=FAST, tp_sizes=TP)
    best = choice.best
    assert best.fits and best.layout.ep > 1
    a2a = next(c for c in best.collectives if c.op == "all-to-all")
    assert a2a.link == "intra-node"  # the tokens' round trip stays inside a node
    assert f"expert parallelism ep={best.layout.ep}" in choice.reason and "the mean tokens" in choice.reason
    without = min((e for e in choice.ranked if e.layout.ep == 1 and e.fits), key=lambda e: e.step_s)
    assert without.step_s > best.step_s and "the best without it" in choice.reason
    assert any(r.estimate.layout.ep == 1 and r.why.startswith("slower by") for r in choice.runners_up)



def test_expert_parallel_candidates_compose_with_pipelines_and_with_tp_under_sp_only():
    # the trainer spreads experts beside pipeline stages, and beside tensor parallelism when each tp rank routes
    # its own sequence slice (--sp): the search offers those and never ep with tp on the same tokens
    ranked = choose_layout(QWEN3_30B_A3B, HW64, 64, 128, 8192, base=FAST, tp_sizes=TP).ranked
    spread = [e.layout for e in ranked if e.layout.ep > 1]
    assert any(lay.pp > 1 for lay in spread) and any(lay.tp > 1 for lay in spread)
    assert all(lay.sp for lay in spread if lay.tp > 1)
    assert any(not e.layout.sp for e in ranked if e.layout.tp > 1 and e.layout.ep == 1)


HW8 = Hardware.nominal("cuda", "NVIDIA H100", memory_gib=80, world=8, gpus_per_node=8)


def test_layout_auto_splits_a_128k_sequence_of_llama3_8b_over_context_parallel_ranks():
    long = choose_layout(LLAMA3_8B, HW8, 8, 8, 131072, base=FAST, tp_sizes=TP)
    assert long.best.fits and long.best.layout.cp > 1 and long.best.layout.pp == 1
    assert not long.best.layout.optimize  # the fused head and loss would see only this rank's tokens
    assert f"context parallelism cp={long.best.layout.cp}" in long.reason
    assert any(c.group == "cp" and c.link == "intra-node" for c in long.best.collectives)
    short = choose_layout(LLAMA3_8B, HW8, 8, 8, 4096, base=FAST, tp_sizes=TP)
    assert all(e.layout.cp == 1 for e in short.ranked) and "context parallelism" not in short.reason


def test_context_parallel_candidates_stay_inside_a_node_and_cut_the_sequence_evenly():
    choice = choose_layout(LLAMA3_8B, HW64, 64, 64, 3 * LONG_SEQUENCE, base=FAST, tp_sizes=TP)
    cps = {e.layout.cp for e in choice.ranked}
    assert cps == {1, 2, 4, 8}
    # context parallelism composes with pipeline stages: both are offered together
    assert any(e.layout.cp > 1 and e.layout.pp > 1 for e in choice.ranked)
    for e in choice.ranked:
        lay = e.layout
        assert lay.cp * lay.tp <= 8 and (3 * LONG_SEQUENCE) % (2 * lay.cp) == 0
        assert lay.pp * lay.dp * lay.cp * lay.tp == 64
    # 16388 tokens cut into 2 x 2 equal chunks, not into 2 x 4 or 2 x 8
    odd = choose_layout(LLAMA3_8B, HW8, 8, 8, LONG_SEQUENCE + 4, base=FAST, tp_sizes=TP)
    assert {e.layout.cp for e in odd.ranked} == {1, 2}


def test_the_search_stays_fast_at_512_ranks_with_cp_and_ep():
    start = time.perf_counter()
    choice = choose_layout(LLAMA3_405B, Hardware.nominal("cuda", "NVIDIA H100", world=512), 512, 512, 131072,
                           base=FAST, tp_sizes=TP)
    # context parallelism with and without pipeline stages: about 8000 candidates
    assert len(choice.ranked) < 10000 and time.perf_counter() - start < 10
    start = time.perf_counter()
    moe = choose_layout(QWEN3_30B_A3B, Hardware.nominal("cuda", "NVIDIA H100", world=512), 512, 1024, 32768,
                        base=FAST, tp_sizes=TP)
    assert len(moe.ranked) < 40000 and time.perf_counter() - start < 30
    assert {e.layout.ep for e in moe.ranked} >= {1, 2, 8, 128}
    assert all(128 % e.layout.ep == 0 and (e.layout.dp * e.layout.cp) % e.layout.ep == 0 for e in moe.ranked)

"""bench/probe_llama_floor.py: the counts the floor probe rests on, against the work's real model."""

import pytest
import torch


def test_parameter_count_is_the_work_models(bench):
    probe = bench("probe_llama_floor")
    baselines = bench("baselines")
    cfg = baselines.model_config("llama", "llama-1.1b", tiny=False)
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(cfg)
    assert probe.n_params() == sum(p.numel() for p in model.parameters())
    assert (probe.HIDDEN, probe.HEADS, probe.INTERMEDIATE, probe.VOCAB, probe.LAYERS) == (
        cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers)
    assert cfg.num_key_value_heads == cfg.num_attention_heads  # k and v are as wide as q, as the probe assumes


def test_step_flops_against_the_harness_model_flops(bench):
    probe, harness = bench("probe_llama_floor"), bench("harness")
    flops = probe.step_flops()
    embedding, norms = probe.VOCAB * probe.HIDDEN, (2 * probe.LAYERS + 1) * probe.HIDDEN
    # the GEMMs: 6 FLOPs per token for every weight but the embedding's (a gather) and the norms'
    assert flops["gemm"] == 6 * (probe.n_params() - embedding - norms) * probe.TOKENS
    # the attention: the harness counts the full square, forward and a backward of twice the forward; cuDNN does
    # the causal half, and its backward recomputes the scores (5 products against the forward's 2, not 4)
    model = harness.transformer_train_flops(0, probe.LAYERS, probe.HIDDEN, probe.SEQ, probe.TOKENS)
    assert flops["attention"] == pytest.approx(model * 0.5 * 7 / 6, rel=1e-12)
    assert flops["total"] == flops["gemm"] + flops["attention"]


def test_min_traffic_adds_up(bench):
    probe = bench("probe_llama_floor")
    t = probe.min_traffic_bytes()
    assert t["step"] == probe.LAYERS * (t["layer_forward"] + t["layer_backward"]) + t["ends"]
    # at least reading and writing every activation of a layer once
    assert t["layer_forward"] > 2 * probe.TOKENS * (probe.HIDDEN + probe.INTERMEDIATE) * 2

"""bench/probe_llama_floor.py: the counts the floor probe rests on, against the work's real model, and a tiny run."""

import json

import pytest
import torch


def test_parameter_count_is_the_work_models(bench):
    probe, baselines = bench("probe_llama_floor"), bench("baselines")
    cfg = baselines.model_config("llama", "llama-1.1b", tiny=False)
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(cfg)
    shape = probe.WORK
    assert probe.n_params(shape) == sum(p.numel() for p in model.parameters())
    assert (shape.hidden, shape.heads, shape.intermediate, shape.vocab, shape.layers) == (
        cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers)
    assert cfg.num_key_value_heads == cfg.num_attention_heads  # k and v are as wide as q, as the probe assumes


@pytest.mark.parametrize("shape_name", ["WORK", "TINY"])
def test_step_flops_against_the_harness_model_flops(bench, shape_name):
    probe, harness = bench("probe_llama_floor"), bench("harness")
    shape = getattr(probe, shape_name)
    flops = probe.step_flops(shape)
    embedding, norms = shape.vocab * shape.hidden, (2 * shape.layers + 1) * shape.hidden
    # the GEMMs: 6 FLOPs per token for every weight but the embedding's (a gather) and the norms'
    assert flops["gemm"] == 6 * (probe.n_params(shape) - embedding - norms) * shape.tokens
    # the attention: the harness counts the full square, forward and a backward of twice the forward; cuDNN does
    # the causal half, and its backward recomputes the scores (5 products against the forward's 2, not 4)
    model = harness.transformer_train_flops(0, shape.layers, shape.hidden, shape.seq, shape.tokens)
    assert flops["attention"] == pytest.approx(model * 0.5 * 7 / 6, rel=1e-12)
    assert flops["total"] == flops["gemm"] + flops["attention"]


def test_min_traffic_adds_up(bench):
    probe = bench("probe_llama_floor")
    shape = probe.WORK
    t = probe.min_traffic_bytes(shape)
    assert t["step"] == shape.layers * (t["layer_forward"] + t["layer_backward"]) + t["ends"]
    # at least reading and writing every activation of a layer once
    assert t["layer_forward"] > 2 * shape.tokens * (shape.hidden + shape.intermediate) * 2


def test_an_fp32_stream_adds_its_extra_bytes_and_nothing_else(bench):
    probe = bench("probe_llama_floor")
    shape = probe.WORK
    a = shape.tokens * shape.hidden * 2  # one bf16 activation of tokens x hidden
    bf16, fp32 = probe.min_traffic_bytes(shape), probe.min_traffic_bytes(shape, stream_bytes=4)
    assert bf16 == probe.min_traffic_bytes(shape, stream_bytes=2)
    # forward: two fused add + norm passes each read and write the stream, now twice as wide
    assert fp32["layer_forward"] - bf16["layer_forward"] == 2 * 2 * a
    # backward: per norm the stream, the residual gradient read and written (3 x a more), and its bf16 copy
    assert fp32["layer_backward"] - bf16["layer_backward"] == 2 * (3 * a + a)
    assert fp32["ends"] - bf16["ends"] == 4 * a + shape.vocab * shape.hidden * 2
    assert fp32["step"] == shape.layers * (fp32["layer_forward"] + fp32["layer_backward"]) + fp32["ends"]
    with pytest.raises(ValueError, match="stream_bytes=3"):
        probe.min_traffic_bytes(shape, stream_bytes=3)


def test_tiny_run_writes_a_probe_without_rows(bench, tmp_path):
    probe = bench("probe_llama_floor")
    out = probe.main(["--tiny", "--rounds", "1", "--results-dir", str(tmp_path)])
    assert [s["variant"] for s in out["steps"]] == ["gemms+attention", "+adamw", "+min-traffic",
                                                       "+min-traffic-fp32-stream"]
    assert all(s["ms"] > 0 for s in out["steps"])
    (path,) = tmp_path.glob("*-probe-llama-floor.json")
    data = json.loads(path.read_text())
    # no rows and no GPU, so that the README's tables never take the probe for a timing
    assert data["rows"] == [] and data["gpus"] == 0 and data["probe"]["shape"]["layers"] == 2

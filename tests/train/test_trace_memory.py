"""--dry-run --trace-memory: one rank of the planned job built by the trainer's code on fake tensors and a fake
process group, its traced peak beside the cost model's formula (schedlang.autotune.step_cost)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from schedlang import train as trainer
from schedlang.train.flags import TrainError, build_parser, validate
from schedlang.train.layout import check_model_layout, model_facts
from schedlang.train.trace_memory import TraceMemoryError, trace_peak

#: a small LLaMA (grouped-query attention, untied head): big enough that activations, weights and logits all count
SMALL_LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8,
               "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 1000, "max_position_embeddings": 512,
               "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "config.json"
    path.write_text(json.dumps(SMALL_LLAMA))
    return str(path)


def _flags(config, *layout):
    return ["--dry-run", "--config", str(config), "--device", "cpu", "--dtype", "bf16", "--global-batch", "64",
            "--seq", "128", *layout]


def _trace(config, *layout):
    ns = build_parser().parse_args(_flags(config, *layout))
    world = validate(ns, ns.nproc or 1)
    facts = model_facts(ns, check_tensor_parallel=world > 1)
    check_model_layout(ns, facts)
    return trace_peak(ns, facts, world)


# world sizes 8 and 64: FSDP2 on dp only, HSDP, tp + dp with and without sequence parallelism, the first stage of
# pp=2, full and selective activation checkpointing, full with and without a pipeline
GRID = {
    "fsdp-8": ("--nproc", "8", "--dp", "8"),
    "hsdp-64": ("--nodes", "8", "--gpus-per-node", "8", "--dp-replicate", "8", "--dp-shard", "8"),
    "tp-sp-64": ("--nodes", "8", "--gpus-per-node", "8", "--dp", "32", "--tp", "2", "--sp"),
    "pp2-ac-full-64": ("--nodes", "8", "--gpus-per-node", "8", "--dp", "32", "--pp", "2",
                       "--activation-checkpoint", "full"),
    # two microbatches, both forward before the first stage's first backward: its gradients come with that
    # backward, and are whole once it has freed its microbatch (the formula's freed_before_grads_bytes)
    "pp2-8": ("--nproc", "8", "--dp", "4", "--pp", "2"),
    # the peak is in the backward of a recomputed layer, after the loss's backward has freed the logits: the formula
    # counts the larger of the two, not both
    "fsdp-ac-full-8": ("--nproc", "8", "--dp", "8", "--activation-checkpoint", "full"),
    "fsdp-ac-selective-8": ("--nproc", "8", "--dp", "8", "--activation-checkpoint", "selective"),
    # tp 4: the column-parallel matmuls' input gradients are the whole hidden width on every tp rank
    "tp4-sp-ac-full-64": ("--nodes", "8", "--gpus-per-node", "8", "--dp", "16", "--tp", "4", "--sp",
                          "--activation-checkpoint", "full"),
    "tp4-ac-selective-64": ("--nodes", "8", "--gpus-per-node", "8", "--dp", "16", "--tp", "4",
                            "--activation-checkpoint", "selective"),
    # the first stage of pp 2 beside tp 4: the stage sends no causal mask to the next (the trainer's rows count their
    # positions up, so transformers leaves causality to SDPA; the trace answers its packed-sequence check so too)
    "pp2-tp4-sp-ac-full-64": ("--nodes", "8", "--gpus-per-node", "8", "--dp", "8", "--pp", "2", "--tp", "4", "--sp",
                              "--activation-checkpoint", "full", "--microbatches", "4"),
    # two stages per rank: rank 0 runs stages 0 and 2 in torch's interleaved order; stage 2 keeps a receive buffer
    # per microbatch for its input, which relays the rotary embeddings and positions beside the hidden states
    "pp2-interleaved-tp2-sp-ac-full-64": ("--nodes", "8", "--gpus-per-node", "8", "--dp", "16", "--pp", "2", "--tp", "2",
                                          "--sp", "--pp-schedule", "Interleaved1F1B", "--microbatches", "4",
                                          "--activation-checkpoint", "full"),
}


@pytest.mark.parametrize("layout", list(GRID.values()), ids=list(GRID))
def test_the_formula_is_within_ten_percent_of_the_trace(config, layout):
    traced = _trace(config, *layout)
    assert traced.tensor_bytes > 0 and traced.allowance_bytes == 0  # a CPU plan allows nothing beyond tensors
    assert abs(traced.gap) <= 0.10, traced.line()


def test_the_trace_counts_what_the_layout_shards(config):
    """Independent of the formula: the traced peak falls as FSDP2 shards the weights and state over more ranks,
    and the sharded parameters it saw are the model's fp32 bytes over the shard count."""
    eight = _trace(config, "--nproc", "8", "--dp", "8", "--global-batch", "8")
    sixty_four = _trace(config, "--nodes", "8", "--gpus-per-node", "8", "--dp", "64", "--global-batch", "64")
    assert sixty_four.peak_bytes < eight.peak_bytes
    params = sum(v for k, v in eight.by_kind.items() if k == "Sharded Param")
    n = 256 * 1000 * 2 + 4 * (4 * 256 * 256 - 2 * 256 * 128 + 3 * 256 * 688 + 2 * 256) + 256
    assert params == pytest.approx(4 * n / 8, rel=0.01)


def test_the_cli_prints_the_traced_line_and_leaves_no_state(config, capsys):
    rng = torch.random.get_rng_state()
    code = trainer.main(_flags(config, "--nproc", "8", "--dp", "8", "--trace-memory"))
    err = capsys.readouterr().err
    assert code == 0, err
    line = next(l for l in err.splitlines() if "peak per rank: formula" in l)
    assert line.startswith("schedlang train: peak per rank: formula ") and " GiB, traced " in line and "%)" in line
    assert not dist.is_initialized()  # the fake process group is gone
    assert torch.equal(torch.random.get_rng_state(), rng)  # the trainer's seeding did not leak


def test_json_has_the_traced_peak(config, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert trainer.main(_flags(config, "--nproc", "8", "--dp", "8", "--trace-memory", "--json", str(out))) == 0
    data = json.loads(out.read_text())
    line = next(l for l in capsys.readouterr().err.splitlines() if "peak per rank" in l)
    traced = float(line.split("traced ")[1].split(" GiB")[0])
    assert data["traced_peak_gib"] == pytest.approx(traced, rel=0.01)
    # beside the formula of the traced (eager) layout, which the line compares it with
    formula = float(line.split("formula ")[1].split(" GiB")[0])
    assert data["traced_formula_peak_gib"] == pytest.approx(formula, rel=0.01)
    assert trainer.main(_flags(config, "--nproc", "8", "--dp", "8", "--json", str(out))) == 0
    assert "traced_peak_gib" not in json.loads(out.read_text())


def test_refusals_name_the_flag(config, capsys):
    ns = build_parser().parse_args(["--config", config, "--trace-memory"])
    with pytest.raises(TrainError, match="--trace-memory runs the peak rank of the plan of --dry-run"):
        validate(ns, 1)
    with pytest.raises(TraceMemoryError, match="--trace-memory with --float8: .*drop --float8"):
        _trace(config, "--nproc", "8", "--dp", "8", "--float8")
    with pytest.raises(TraceMemoryError, match="--pp-schedule ZeroBubble: .*1F1B, GPipe, Interleaved1F1B"):
        _trace(config, "--nproc", "8", "--dp", "4", "--pp", "2", "--pp-schedule", "ZeroBubble",
               "--microbatches", "4", "--global-batch", "64")
    assert not dist.is_initialized()


def test_the_packed_sequence_check_answers_as_on_the_run_s_positions():
    """On fake position ids transformers' check cannot read the values and answers "packed" (which makes it build a
    [b, 1, s, s] mask); the trace answers it on the positions rank 0 holds: plain counts, one sequence per row, are
    not packed, while context parallelism's two load-balanced chunks restart (as the run's check finds too)."""
    import argparse

    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import masking_utils

    from schedlang.train.trace_memory import _packing_answered_as_the_run_would

    original = masking_utils.find_packed_sequence_indices
    assert original(torch.arange(16).expand(2, -1)) is None  # real counted positions: not packed
    with FakeTensorMode():
        fake_positions = torch.arange(16).expand(2, -1)
        assert original(fake_positions) is not None  # unreadable: transformers assumes packing
        with _packing_answered_as_the_run_would(argparse.Namespace(cp=None)):
            assert masking_utils.find_packed_sequence_indices(fake_positions) is None
        with _packing_answered_as_the_run_would(argparse.Namespace(cp=2)):
            assert masking_utils.find_packed_sequence_indices(torch.arange(8).expand(2, -1)) is not None
    assert masking_utils.find_packed_sequence_indices is original  # given back


def test_a_pipeline_stage_sends_no_causal_mask(config):
    """The first stage's outputs under the trace are what the run's are: no [b, 1, s, s] mask among them."""
    sent = []
    original = torch.autograd.backward

    def record(tensors, grad_tensors=None, **kwargs):
        sent.extend(tuple(t.shape) for t in tensors)
        return original(tensors, grad_tensors, **kwargs)

    torch.autograd.backward = record
    try:
        _trace(config, "--nproc", "8", "--dp", "4", "--pp", "2")
    finally:
        torch.autograd.backward = original
    assert sent and not any(len(shape) == 4 and shape[-2:] == (128, 128) for shape in sent), sent

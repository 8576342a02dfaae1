"""--layout auto and --dry-run: the layout chosen from the model, the devices' memory and the link by the
cost model (schedlang.autotune.training_cost), explained before anything is allocated; --probe on gloo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schedlang import train as trainer
from schedlang.autotune.training_cost import GIB, Hardware, Layout, ModelShape, choose_layout, estimate_step

#: LLaMA-1.1B as the trainer's --config 1b and the benchmark build it (TinyLlama's depth and width, full multi-head
#: attention: 1.26B parameters)
LLAMA_1B = ModelShape(layers=22, hidden=2048, heads=16, kv_heads=16, head_dim=128, intermediate=5632, vocab=32000,
                      params=1_261_529_088, flops_params=1_195_993_088, embedding_params=131_072_000)
FAST = Layout(dtype="bf16", optimize=True, compiled=True, optimizer="fused-adamw")


def test_two_h200s_get_the_benchmarks_fastest_layout_for_llama_1b(capsys):
    """torchrun --nproc_per_node=2 -m schedlang.train --config 1b --global-batch 8 --seq 2048 on 2 x H200 (141 GiB,
    NVLink): FSDP2 without resharding, gradients reduced in bf16, optimize_model, per-layer compile, FusedAdamW,
    the fastest schedlang row of bench/bench_train.py's llama-1.1b-2gpu work."""
    code = trainer.main(["--dry-run", "--nproc", "2", "--device", "cuda", "--config", "1b", "--global-batch", "8",
                         "--seq", "2048", "--gpu-memory-gib", "141", "--link-gbps", "300"])
    assert code == 0
    err = capsys.readouterr().err
    assert "--layout auto chose pp=1 dp=2 tp=1 (fsdp no-reshard bf16-reduce)" in err, err
    assert "layout      pp=1 dp=2 tp=1 (fsdp no-reshard bf16-reduce); bf16, compile, optimize_model, fused-adamw" in err
    for part in ("per rank    params", "all-gather over dp: FSDP2 weights, 22 x", "reduce-scatter over dp: FSDP2 "
                 "gradients", "estimate    ", "tokens/s", "why: "):
        assert part in err, (part, err)


def test_the_cost_model_ranks_what_the_benchmarks_measured():
    hw = Hardware.nominal("cuda", "NVIDIA H200", memory_gib=141, link_gbps=300)
    choice = choose_layout(LLAMA_1B, hw, 2, 8, 2048, base=FAST, tp_sizes=[1, 2])
    by_layout = {e.layout.describe(): e for e in choice.ranked}
    best = choice.best
    assert best.layout.describe() == "pp=1 dp=2 tp=1 (fsdp no-reshard bf16-reduce)"
    # measured on 2 x H200 (bench/results/2026-11-28-train-2gpu*.json): FSDP2 no-reshard bf16 < fp32 < DDP < TP=2
    assert best.step_s < by_layout["pp=1 dp=2 tp=1 (fsdp no-reshard)"].step_s
    assert by_layout["pp=1 dp=2 tp=1 (fsdp no-reshard)"].step_s < by_layout["pp=1 dp=2 tp=1 (ddp)"].step_s
    assert by_layout["pp=1 dp=2 tp=1 (ddp)"].step_s < by_layout["pp=1 dp=1 tp=2"].step_s
    # within 15% of the measured 136.7 ms (119,849 tokens/s)
    assert best.step_s == pytest.approx(0.1367, rel=0.15)
    assert "FSDP2 shards the optimizer step and state" in choice.reason and "bf16 gradient reduction" in choice.reason


def test_memory_decides_resharding_and_checkpointing():
    """LLaMA-3-8B's shapes on 2 GPUs: on 141 GiB FSDP2 keeps the gathered weights and every activation; on 72 GiB
    it reshards and recomputes part of each layer; on 40 GiB nothing fits, and the reason says so."""
    llama_8b = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                          vocab=128256, params=8_030_261_248, flops_params=7_504_924_672,
                          embedding_params=1_050_673_152)

    def choose(gib):
        return choose_layout(llama_8b, Hardware.nominal("cuda", "NVIDIA H100", memory_gib=gib, link_gbps=300), 2, 4,
                             2048, base=FAST, tp_sizes=[1, 2])

    roomy, small, tiny = choose(141), choose(72), choose(40)
    assert roomy.best.fits and roomy.best.layout.activation_checkpoint == "none" and not roomy.best.layout.reshard
    # selective recomputes less than full checkpointing and fits: the faster of the two
    assert small.best.fits and small.best.layout.activation_checkpoint == "selective" and small.best.layout.reshard
    assert "resharding after forward: keeping the gathered weights would not fit" in small.reason
    assert "activation checkpointing: without it" in small.reason
    assert small.best.total_bytes <= 0.9 * 72 * GIB
    assert not tiny.best.fits and tiny.reason.startswith("no layout fits the estimated memory")
    # the peak is what stays plus the larger of two moments, and checkpointing trades memory for a recomputed
    # forward (its peak is at the end of the backward, when every gradient is there)
    e = small.best
    stays = e.params_bytes + e.optimizer_bytes + e.other_bytes
    assert e.total_bytes == pytest.approx(stays + max(e.forward_peak_bytes, e.backward_peak_bytes))
    assert e.backward_peak_bytes == pytest.approx(e.grads_bytes + e.gathered_bytes + e.working_bytes)
    assert e.forward_peak_bytes == pytest.approx(e.gathered_bytes + e.activation_bytes)
    hw = Hardware.nominal("cuda", "NVIDIA H100", memory_gib=72, link_gbps=300)
    plain, full = (estimate_step(llama_8b, Layout(**{**e.layout.__dict__, "activation_checkpoint": mode}), hw, 4, 2048)
                   for mode in (False, "full"))
    assert plain.layout.activation_checkpoint == "none"  # the bool of older callers still reads
    assert plain.activation_bytes > e.activation_bytes > full.activation_bytes
    assert plain.compute_s < e.compute_s < full.compute_s


def test_gradients_count_at_the_forward_peak_only_where_they_outlive_a_step():
    """Zeroed to None after each step, the gradients come only as the activations go; accumulated over
    microbatches (and in a pipeline) they are there while the activations are."""
    hw = Hardware.nominal("cuda", "NVIDIA H200", memory_gib=141, link_gbps=300)
    one = estimate_step(LLAMA_1B, Layout(**{**FAST.__dict__, "dp": 2}), hw, 8, 2048)
    accumulated = estimate_step(LLAMA_1B, Layout(**{**FAST.__dict__, "dp": 2, "microbatches": 2}), hw, 8, 2048)
    piped = estimate_step(LLAMA_1B, Layout(**{**FAST.__dict__, "pp": 2, "microbatches": 4}), hw, 8, 2048)
    assert not one.grads_in_forward and accumulated.grads_in_forward and piped.grads_in_forward
    assert one.forward_peak_bytes == pytest.approx(one.gathered_bytes + one.activation_bytes)
    assert accumulated.forward_peak_bytes == pytest.approx(accumulated.gathered_bytes + accumulated.grads_bytes
                                                           + accumulated.activation_bytes)


def _newest_gpu_memory_rows():
    results = sorted((Path(__file__).resolve().parents[2] / "bench" / "results").glob("*-train-memory.json"))
    if not results:
        return None, []
    data = json.loads(results[-1].read_text())
    return data, [r for r in data["rows"] if r.get("check") == "ok"]


def test_the_memory_estimate_is_within_15_percent_of_the_measured_gpu_peaks(capsys):
    """bench/train_memory.py measured the trainer's peak per layout on GPUs (``measured_gib``); the cost model as it
    is now, given the same flags, model and GPU memory, estimates each within 15%."""
    data, rows = _newest_gpu_memory_rows()
    assert data is not None and data["gpus"] >= 2 and len(rows) >= 5, "no GPU measurements of the trainer's memory"
    errors = {}
    for row in rows:
        flags = row["layout_flags"].split() if row["layout_flags"] != "(defaults)" else []
        code = trainer.main(["--dry-run", "--nproc", str(data["gpus"]), "--device", "cuda", "--config", "1b",
                             "--global-batch", "8", "--seq", "2048", "--gpu-memory-gib", "139.8", "--link-gbps",
                             "258", *flags])
        assert code == 0
        line = next(l for l in capsys.readouterr().err.splitlines() if l.startswith("  per rank    "))
        estimated = float(line.split("= peak ")[1].split(" GiB")[0])
        errors[row["variant"]] = row["measured_gib"] / estimated - 1
    assert all(abs(e) <= 0.15 for e in errors.values()), errors


def test_a_dry_run_of_a_manual_layout_shows_its_collectives_and_builds_nothing(capsys, monkeypatch):
    import schedlang.distributed.launch as launch

    def refuse(*args, **kwargs):
        raise AssertionError("a dry run spawned ranks")

    monkeypatch.setattr(launch, "run_distributed", refuse)
    code = trainer.main(["--dry-run", "--nproc", "4", "--dp", "2", "--tp", "2", "--sp", "--device", "cpu",
                         "--config", "tiny", "--seq", "32"])
    assert code == 0
    err = capsys.readouterr().err
    assert "layout      pp=1 dp=2 tp=2 (sp, fsdp); fp32, eager, adamw" in err
    assert "all-gather over tp: sequence-parallel activations, 16 x" in err
    assert "reduce-scatter over dp: FSDP2 gradients" in err and "--layout auto" not in err


@pytest.mark.parametrize("flags, message", [
    (["--layout", "auto", "--dp", "2"], "--layout auto chooses --dp, --tp and --pp itself, but --dp 2 was given; "
                                        "drop --dp 2 or --layout auto"),
    (["--probe", "--dp", "1"], "--probe times the best layouts --layout auto finds: it needs --layout auto"),
    (["--gpu-memory-gib", "0"], "--gpu-memory-gib must be a positive number, got 0.0"),
    (["--nproc", "3", "--global-batch", "4", "--config", "tiny"], "--layout auto: no layout of 3 ranks fits global "
                                                                  "batch 4 and the model (4 layers; tensor-parallel "
                                                                  "sizes [1]); give --global-batch a multiple of the "
                                                                  "world size 3"),
])
def test_layout_flags_fail_with_a_clear_message(flags, message, capsys):
    assert trainer.main(["--device", "cpu", "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("schedlang train: error: ") and message in err, err


def test_layout_auto_on_two_ranks_trains_and_probes(tmp_path):
    """With no --dp/--tp/--pp on 2 ranks the trainer chooses a layout from the measured link (on a CPU the
    estimates are rough: which one is not pinned), says why, times the two best layouts with --probe, and trains
    the losses of one process."""
    import subprocess
    import sys

    flags = ["--config", "tiny", "--steps", "2", "--global-batch", "4", "--seq", "32", "--device", "cpu", "--seed",
             "5"]
    single = tmp_path / "single.jsonl"
    assert trainer.main(flags + ["--metrics", str(single)]) == 0
    auto = tmp_path / "auto.jsonl"
    result = subprocess.run([sys.executable, "-m", "schedlang.train", *flags, "--nproc", "2", "--probe", "--metrics",
                             str(auto)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    err = result.stderr
    assert "--layout auto chose pp=" in err and "interconnect" in err and "(measured)" in err
    assert err.count("--probe pp=") == 2 and "--probe keeps" in err
    assert "schedlang train plan: llama tiny" in err and "per rank    params" in err
    records = [json.loads(line) for line in auto.read_text().splitlines()]
    reference = [json.loads(line) for line in single.read_text().splitlines()]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], rel=1e-5)
    assert all(r["mem_estimated_gib"] > 0 for r in records)


def test_70b_with_tp8_and_sequence_parallelism_fits_and_405b_lists_runners_up(capsys):
    """torchtitan's 70B layout (FSDP x TP 8 with SP and full checkpointing) fits 8 nodes of H100s: SP splits the
    layers' saved inputs 8 ways; --layout auto on 512 GPUs names its runners-up."""
    base = ["--dry-run", "--device", "cuda", "--gpu-memory-gib", "80", "--seq", "8192"]
    assert trainer.main(base + ["--nodes", "8", "--config", "70b", "--global-batch", "64", "--tp", "8", "--dp", "8",
                                "--sp", "--activation-checkpoint", "--microbatches", "8"]) == 0
    err = capsys.readouterr().err
    assert "DOES NOT FIT" not in err and "pp=1 dp=8 tp=8 (sp, fsdp, 8 accumulation steps, activation checkpointing)" in err
    assert "all-gather over tp: sequence-parallel activations" in err and "intra-node" in err
    assert trainer.main(base + ["--nodes", "64", "--config", "405b", "--global-batch", "512"]) == 0
    err = capsys.readouterr().err
    assert err.count("  runner-up: ") >= 3 and ("slower by" in err or "does not fit" in err)

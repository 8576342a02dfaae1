"""The trainer with ``--cp``: the losses and gradient norms of one process, with cp alone, beside tensor
parallelism and beside data parallelism (FSDP and DDP); a checkpoint saved at cp=2 resumes exactly under
dp=2; flags that cannot work are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schedlang import train as trainer
from tests.helpers.trainer_runs import assert_same_steps, run_metrics

COMMON = ["--model", "llama", "--config", "tiny", "--steps", "4", "--global-batch", "4", "--seq", "24",
          "--lr", "3e-3", "--device", "cpu", "--dtype", "fp32", "--seed", "7"]


def _run(tmp: Path, name: str, *flags: str):
    return run_metrics(COMMON + list(flags), tmp / f"{name}.jsonl")


_assert_same = assert_same_steps


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("train_cp")


@pytest.fixture(scope="module")
def reference(work):
    return _run(work, "single")


def test_cp2_trains_like_one_process_and_resumes_under_dp2(reference, work):
    _assert_same(_run(work, "cp2", "--nproc", "2", "--cp", "2"), reference)
    ckpt = work / "ckpt"
    first = _run(work, "stop-cp2", "--nproc", "2", "--cp", "2", "--checkpoint-dir", str(ckpt), "--stop-after", "2")
    assert [r["step"] for r in first] == [1, 2]
    resumed = _run(work, "resume-dp2", "--nproc", "2", "--dp", "2", "--checkpoint-dir", str(ckpt), "--resume")
    assert [r["step"] for r in resumed] == [3, 4]
    _assert_same(resumed, reference)


def test_cp2_beside_tp2_trains_like_one_process(reference, work):
    _assert_same(_run(work, "cp2-tp2", "--nproc", "4", "--cp", "2", "--tp", "2"), reference)


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_cp2_beside_dp2_trains_like_one_process(reference, work, mode):
    # the data-parallel reduction runs over dp and cp flattened: each of the four ranks holds a quarter of
    # the step's tokens (half the batch, half of each sequence)
    _assert_same(_run(work, f"cp2-dp2-{mode}", "--nproc", "4", "--cp", "2", "--dp", "2", "--dp-mode", mode),
                 reference)


@pytest.mark.parametrize("flags, message", [
    (["--nproc", "2", "--cp", "2", "--seq", "26"],
     "--seq 26 does not split over --cp 2: each sequence is cut into 2 x cp = 4 equal chunks (rank r holds chunks r "
     "and 3 - r), so --seq must be a multiple of 4, e.g. 24 or 28"),
    (["--nproc", "3", "--cp", "2"], "--dp 1 x --tp 1 x --pp 1 x --cp 2 = 2 ranks, but the run has 3"),
    (["--nproc", "2", "--cp", "2", "--optimize"], "--optimize fuses the head with a loss inside the model"),
])
def test_flags_that_cannot_work_are_named(flags, message, capsys):
    assert trainer.main(COMMON + flags) == 2
    assert message in capsys.readouterr().err


def test_the_planner_splits_activations_over_cp_and_counts_the_kv_exchange_on_its_link():
    from schedlang.autotune.training_cost import Hardware, Layout, ModelShape, estimate_step, layout_json

    shape = ModelShape(layers=4, hidden=256, heads=8, kv_heads=2, head_dim=32, intermediate=512, vocab=1000,
                       params=3_000_000, flops_params=2_500_000, embedding_params=512_000)
    hw = Hardware.nominal("cuda", memory_gib=80, world=8, gpus_per_node=4)
    whole = estimate_step(shape, Layout(dp=2, tp=2), hw, global_batch=4, seq=4096)
    split = estimate_step(shape, Layout(dp=2, tp=2, cp=2), hw, global_batch=4, seq=4096)
    # every layer's saved activations and the logits are split over cp; a layer's backward also holds FSDP's
    # gradients of the layer, which are not
    def saved(e):
        return e.activation_bytes - max(e.logits_bytes, e.layer_backward_bytes)

    assert saved(split) == pytest.approx(saved(whole) / 2)
    assert split.logits_bytes == pytest.approx(whole.logits_bytes / 2)
    assert whole.activation_bytes / 2 < split.activation_bytes < whole.activation_bytes
    kv = [c for c in split.collectives if c.group == "cp"]
    assert [c.what for c in kv] == ["context-parallel keys and values", "context-parallel key and value gradients"]
    full_kv = 2 * 4096 * 2 * 2 * 32 / 2 * 2  # rows x seq x (K, V) x kv heads x head dim / tp x bf16 bytes
    assert kv[0].count == 4 and kv[0].bytes_each == pytest.approx(full_kv)
    assert kv[0].wire_bytes == pytest.approx(4 * full_kv / 2)
    # cp inside dp, outside tp: with 4 GPUs a node, cp's group (stride tp=2, 2 ranks) stays in the node; FSDP's
    # group (dp x cp) spans both nodes
    from schedlang.autotune.cluster import NETWORK, NVLINK

    assert kv[0].link == NVLINK
    wide = estimate_step(shape, Layout(dp=1, tp=2, cp=4), hw, global_batch=4, seq=4096)
    assert {c.link for c in wide.collectives if c.group == "cp"} == {NETWORK}  # 4 cp ranks 2 apart: two nodes
    assert layout_json(split)["cp"] == 2 and layout_json(whole)["cp"] == 1
    assert "cp=2" in split.layout.describe()
    # cp alone: FSDP shards over the cp ranks, as the trainer does
    alone = estimate_step(shape, Layout(cp=2), hw, global_batch=4, seq=4096)
    whole_alone = estimate_step(shape, Layout(), hw, global_batch=4, seq=4096)
    assert alone.params_bytes == pytest.approx(whole_alone.params_bytes / 2)
    assert any(c.op == "reduce-scatter" and c.group == "dp" for c in alone.collectives)


def test_dry_run_json_has_the_real_cp(tmp_path):
    out = tmp_path / "plan.json"
    assert trainer.main(["--model", "llama", "--config", "tiny", "--seq", "64", "--global-batch", "4", "--dry-run",
                         "--nodes", "1", "--gpus-per-node", "4", "--dp", "2", "--cp", "2", "--json", str(out)]) == 0
    layout = json.loads(out.read_text())["layout"]
    assert layout["cp"] == 2 and layout["dp"] == 2 and "cp=2" in layout["describe"]

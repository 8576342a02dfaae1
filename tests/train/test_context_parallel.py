"""The trainer with ``--cp``: the losses and gradient norms of one process, with cp alone and beside tensor
parallelism; a checkpoint saved at cp=2 resumes exactly under dp=2; flags that cannot work are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from schedlang import train as trainer

COMMON = ["--model", "llama", "--config", "tiny", "--steps", "4", "--global-batch", "4", "--seq", "24",
          "--lr", "3e-3", "--device", "cpu", "--dtype", "fp32", "--seed", "7"]


def _run(tmp: Path, name: str, *flags: str):
    metrics = tmp / f"{name}.jsonl"
    assert trainer.main(COMMON + ["--metrics", str(metrics)] + list(flags)) == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _assert_same(records, reference):
    steps = [r["step"] for r in records]
    ref = [r for r in reference if r["step"] in steps]
    assert steps == [r["step"] for r in ref]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records]), torch.tensor([r["loss"] for r in ref]),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in records]),
                               torch.tensor([r["grad_norm"] for r in ref]), rtol=1e-4, atol=1e-5)


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


@pytest.mark.parametrize("flags, message", [
    (["--nproc", "2", "--cp", "2", "--seq", "26"],
     "--seq 26 does not split over --cp 2: each sequence is cut into 2 x cp = 4 equal chunks (rank r holds chunks r "
     "and 3 - r), so --seq must be a multiple of 4, e.g. 24 or 28"),
    (["--nproc", "4", "--cp", "2", "--pp", "2"],
     "--cp 2 with --pp 2: context parallelism and pipeline stages do not go together yet; drop --pp or --cp"),
    (["--nproc", "3", "--cp", "2"], "--dp 1 x --tp 1 x --pp 1 x --cp 2 = 2 ranks, but the run has 3"),
    (["--nproc", "2", "--cp", "2", "--optimize"], "--optimize fuses the head with a loss inside the model"),
])
def test_flags_that_cannot_work_are_named(flags, message, capsys):
    assert trainer.main(COMMON + flags) == 2
    assert message in capsys.readouterr().err

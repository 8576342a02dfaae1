"""HSDP in the trainer: --dp-replicate 2 --dp-shard 2 on four gloo ranks (FSDP2 sharded over pairs, replicated
across them; the replicas sum their gradient shards after the last accumulated microbatch only) trains the
losses of one process."""

import json
import subprocess
import sys

import pytest

from schedlang import train as trainer

FLAGS = ["--config", "tiny", "--steps", "3", "--global-batch", "8", "--seq", "32", "--device", "cpu", "--seed", "3",
         "--lr", "3e-3", "--microbatches", "2"]


def _losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_hsdp_2x2_trains_the_losses_of_one_process(tmp_path):
    single = tmp_path / "single.jsonl"
    assert trainer.main(FLAGS + ["--metrics", str(single)]) == 0
    hybrid = tmp_path / "hsdp.jsonl"
    result = subprocess.run([sys.executable, "-m", "schedlang.train", *FLAGS, "--nproc", "4", "--dp-replicate", "2",
                             "--dp-shard", "2", "--metrics", str(hybrid)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pp=1 dp=4 tp=1 (hsdp 2x2" in result.stderr, result.stderr[-3000:]
    reference = _losses(single)
    assert len(reference) == 3 and reference[0] != reference[-1]  # it trains
    assert _losses(hybrid) == pytest.approx(reference, rel=1e-5)

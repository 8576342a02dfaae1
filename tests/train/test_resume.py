"""A long run survives a killed rank and a broken checkpoint (``schedlang.train.resume``).

* Under ``torchrun --max-restarts=1`` one rank is killed with SIGKILL mid-run; torchrun restarts the group
  with the same command line (``--resume``) and the run continues from its newest complete checkpoint: every
  step's loss, the final weights and the metrics file equal those of an uninterrupted run.
* The newest checkpoint is damaged in the ways a cut-off save or a bad copy leaves it; the run resumes from
  the one before it, naming the step it skipped and why.
* ``--async-save`` checkpoints resume exactly as synchronous ones do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from schedlang import train as trainer
from schedlang.train.resume import open_metrics

COMMON = ["--model", "llama", "--config", "tiny", "--global-batch", "4", "--seq", "32", "--lr", "3e-3",
          "--device", "cpu", "--dtype", "fp32", "--seed", "5", "--timeout", "120", "--log-every", "1000"]


def _records(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(tmp: Path, name: str, *flags: str):
    metrics = tmp / f"{name}.jsonl"
    args = COMMON + ["--metrics", str(metrics)] + list(flags)
    assert trainer.main(args) == 0, f"the trainer failed for {args}"
    return _records(metrics)


def _losses(records):
    return {r["step"]: r["loss"] for r in records}


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "schedlang.train" and r.levelname == "WARNING"]


# ---------------------------------------------------------------------------------------------- metrics file
def test_a_resumed_run_keeps_the_metrics_up_to_its_checkpoint(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    lines = [json.dumps({"step": s, "loss": float(s)}) for s in (1, 2, 3, 4, 5, 3)]  # 3 again: a restart's own
    path.write_text("\n".join(lines) + '\n{"step": 6, "lo')  # the last line cut short by the kill
    with open_metrics(str(path), 4) as f:
        f.write(json.dumps({"step": 5, "loss": 50.0}) + "\n")
    assert [(r["step"], r["loss"]) for r in _records(path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0)]
    assert ("--metrics %s: dropped the records of steps 3..5, after the step the run resumes from (4); and a line "
            "cut short" % path) in _warnings(caplog)
    assert not (tmp_path / "m.jsonl.partial").exists()
    with open_metrics(str(path), None):  # a fresh run starts the file empty
        pass
    assert path.read_text() == ""
    with open_metrics(str(tmp_path / "new.jsonl"), 0):  # resumed with no checkpoint: nothing to keep
        pass
    assert (tmp_path / "new.jsonl").read_text() == ""


# ---------------------------------------------------------------------------------------------- broken checkpoints
STEPS = ["--steps", "4"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def reference(work):
    """One process, 4 steps, never interrupted."""
    return _losses(_run(work, "reference", *STEPS))


@pytest.fixture(scope="module")
def saved_every_step(work):
    """The same run stopped after step 3, with a checkpoint after every step."""
    ckpt = work / "ckpt"
    _run(work, "first", *STEPS, "--checkpoint-dir", str(ckpt), "--save-every", "1", "--stop-after", "3")
    return ckpt


def _data_file(step_dir: Path) -> Path:
    (data,) = step_dir.glob("*.distcp")
    return data


def _damage(step_dir: Path, how: str) -> str:
    """Damage a checkpoint as a cut-off save or a bad copy would; returns what the skip warning must say."""
    if how == "truncated-shard":
        data = _data_file(step_dir)
        os.truncate(data, os.path.getsize(data) // 2)
        return f"{data} is truncated"
    if how == "missing-shard":
        os.remove(_data_file(step_dir))
        return f"{_data_file_name(step_dir)} is missing"
    if how == "missing-metadata":
        os.remove(step_dir / ".metadata")
        return "its .metadata file is missing (written last by save_checkpoint; the save may have been interrupted)"
    if how == "corrupt-bytes":  # same size: only reading it finds the damage
        data = _data_file(step_dir)
        with open(data, "r+b") as f:
            f.seek(0)
            f.write(b"\0" * 64)
        return f"cannot read '{step_dir}': rank 0: "
    raise AssertionError(how)


def _data_file_name(step_dir: Path) -> str:
    return str(step_dir / "__0_0.distcp")


@pytest.mark.parametrize("how", ["truncated-shard", "missing-shard", "missing-metadata", "corrupt-bytes"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(how, work, reference, saved_every_step, caplog,
                                                                    capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_every_step, ckpt)
    said = _damage(ckpt / "step-00000003", how)
    (ckpt / "step-00000004.partial").mkdir()  # and a save of step 4 that never finished
    (ckpt / "step-00000004.partial" / "__0_0.distcp").write_bytes(b"\0" * 10)
    capsys.readouterr()
    resumed = _run(tmp_path, "resumed", *STEPS, "--checkpoint-dir", str(ckpt), "--resume")
    # announced at the default log level, whatever logging says: which step, which checkpoint, saved how
    said_resumed = [line for line in capsys.readouterr().err.splitlines() if "resumed" in line]
    assert said_resumed == [f"schedlang train: resumed from the checkpoint of step 2, {ckpt / 'step-00000002'} "
                            "(saved under pp=1 dp=1 tp=1)"], said_resumed
    assert [r["step"] for r in resumed] == [3, 4]
    assert _losses(resumed) == {s: reference[s] for s in (3, 4)}  # bitwise: the same process layout
    warnings = _warnings(caplog)
    skipped = [w for w in warnings if w.startswith(f"--resume: skipping the checkpoint of step 3 "
                                                   f"({ckpt / 'step-00000003'}): ")]
    assert len(skipped) == 1 and said in skipped[0], warnings
    assert "removed step-00000004.partial: saves that did not finish (never loaded)" in warnings
    assert trainer.latest_checkpoint(str(ckpt)).name == "step-00000004"  # the run's own last save


def test_async_saves_resume_exactly(work, reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    layout = ["--nproc", "2", "--dp", "2"]
    first = _run(tmp_path, "first", *STEPS, *layout, "--checkpoint-dir", str(ckpt), "--save-every", "1",
                 "--stop-after", "2", "--async-save")
    assert sorted(os.listdir(ckpt)) == ["step-00000001", "step-00000002"]
    second = _run(tmp_path, "second", *STEPS, *layout, "--checkpoint-dir", str(ckpt), "--resume", "--async-save")
    got = _losses(first + second)
    assert sorted(got) == [1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor([got[s] for s in range(1, 5)]),
                               torch.tensor([reference[s] for s in range(1, 5)]), rtol=1e-5, atol=1e-5)
    assert sorted(os.listdir(ckpt)) == ["step-00000001", "step-00000002", "step-00000004"]


# ---------------------------------------------------------------------------------------------- a killed rank
KILL_STEPS, KILL_SAVE_EVERY, KILL_AT = 24, 4, 6


def _worker_pid(marker: str, rank: int) -> int | None:
    """The process of torchrun's worker ``rank`` of the first attempt, found by the marker in its environment."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(item.split("=", 1) for item in (entry / "environ").read_bytes().decode(errors="replace")
                       .split("\0") if "=" in item)
        except OSError:
            continue
        if (env.get("SCHEDLANG_TEST_RUN") == marker and env.get("RANK") == str(rank)
                and env.get("TORCHELASTIC_RESTART_COUNT") == "0" and "LOCAL_RANK" in env):
            return int(entry.name)
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds torchrun's workers through /proc")
@pytest.mark.timeout(1200)
def test_a_rank_killed_mid_run_restarts_and_continues_exactly(tmp_path):
    flags = COMMON + ["--steps", str(KILL_STEPS), "--dp", "2"]
    # the run never interrupted, on the same layout
    expected = _run(tmp_path, "uninterrupted", "--steps", str(KILL_STEPS), "--nproc", "2", "--dp", "2",
                    "--export-hf", str(tmp_path / "hf-uninterrupted"))
    ckpt, metrics, marker = tmp_path / "ckpt", tmp_path / "killed.jsonl", uuid.uuid4().hex
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc_per_node=2",
               "--max-restarts=1", "-m", "schedlang.train", *flags, "--metrics", str(metrics),
               "--checkpoint-dir", str(ckpt), "--save-every", str(KILL_SAVE_EVERY), "--resume",
               "--export-hf", str(tmp_path / "hf-killed")]
    env = {**os.environ, "SCHEDLANG_TEST_RUN": marker, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "torchrun.log", "w")
    run = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    killed = None
    try:
        deadline = time.monotonic() + 900  # two starts of two ranks each; a loaded machine imports slowly
        while killed is None:
            assert run.poll() is None, "the run ended before a rank was killed:\n" + (tmp_path / "torchrun.log").read_text()
            assert time.monotonic() < deadline, "the run did not reach step %d in time" % KILL_AT
            done = [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
            if done and done[-1] >= KILL_AT:
                killed = _worker_pid(marker, rank=1)
                assert killed is not None, "rank 1 of torchrun's first attempt was not found"
                os.kill(killed, signal.SIGKILL)
                killed_after = done[-1]
            else:
                time.sleep(0.01)
        code = run.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if run.poll() is None:  # hung: fail, never leave it running
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=30)
        log.close()
    output = (tmp_path / "torchrun.log").read_text()
    assert code == 0, output
    assert killed_after < KILL_STEPS, "the kill landed after the run finished"
    # the restart resumed from a checkpoint saved before the kill (or started fresh had none been saved yet)
    # each start of the trainer says which steps it runs ("... steps 1..24 of 24")
    starts = [m for m in (re.search(rf"steps (\d+)\.\.{KILL_STEPS} of {KILL_STEPS}", line)
                          for line in output.splitlines() if line.startswith("schedlang train:")) if m]
    assert len(starts) == 2 and starts[0].group(1) == "1", output
    resumed_at = int(starts[1].group(1)) - 1
    assert resumed_at % KILL_SAVE_EVERY == 0 and resumed_at <= killed_after, starts[1].group(0)
    if resumed_at:  # and the restart named the checkpoint it continued from
        assert (f"schedlang train: resumed from the checkpoint of step {resumed_at}, "
                f"{tmp_path / 'ckpt' / f'step-{resumed_at:08d}'} (saved under pp=1 dp=2 tp=1") in output, output
    # the metrics read as one uninterrupted run: every step once, in order, with its loss
    records = _records(metrics)
    assert [r["step"] for r in records] == list(range(1, KILL_STEPS + 1))
    assert [r["loss"] for r in records] == [r["loss"] for r in expected]
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in expected]
    # and the final weights are the uninterrupted run's
    from safetensors.torch import load_file

    mine, theirs = load_file(tmp_path / "hf-killed" / "model.safetensors"), \
        load_file(tmp_path / "hf-uninterrupted" / "model.safetensors")
    assert sorted(mine) == sorted(theirs)
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name
    assert not list(ckpt.glob("*.partial"))


def test_resuming_a_complete_run_does_nothing_and_succeeds(tmp_path, capsys):
    """The same command line serves every restart, one after the last save included (an elastic agent restarts
    its workers when another node rejoins): the run is complete, nothing trains, the metrics stay as they were."""
    flags = ["--steps", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "2", "--resume"]
    first = _run(tmp_path, "m", *flags)
    assert [r["step"] for r in first] == [1, 2]
    capsys.readouterr()
    assert trainer.main(COMMON + ["--metrics", str(tmp_path / "m.jsonl")] + flags) == 0
    assert "the run is complete: the latest checkpoint" in capsys.readouterr().err
    assert _records(tmp_path / "m.jsonl") == first
    # a checkpoint of another model is still refused, complete or not
    assert trainer.main([f if f != "llama" else "gpt2" for f in COMMON] + flags) == 2

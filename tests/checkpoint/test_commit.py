"""A checkpoint becomes visible only when complete (staging directory, manifest, rename), and a damaged one is
refused with :class:`CheckpointDamagedError`, on every rank, with nothing loaded.

The interrupted saves are real: a child process starts a save and is killed with SIGKILL while the ranks'
files are being written, or after they are written but before the rename. The child holds the save at that
point (the test's own patch of ``os.fsync`` / ``os.replace`` in the child) so that the kill lands there.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import schedlang
from schedlang.checkpoint import CheckpointDamagedError
from schedlang.checkpoint.commit import MANIFEST, staging_path
from tests.helpers.models import MLP


def _saved(path, seed=0, step=1, **kw):
    torch.manual_seed(seed)
    model = MLP(hidden=16, inner=24)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    schedlang.save_checkpoint(path, model, opt, step=step, **kw)
    return model, opt


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_save_appears_whole_with_a_manifest(tmp_path):
    _saved(tmp_path / "c", extra_files={"trainer.json": '{"step": 1}\n', "notes.bin": b"\x00\x01"})
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no staging directory left
    manifest = json.loads((tmp_path / "c" / MANIFEST).read_text())
    assert manifest["format"] == 1 and manifest["step"] == 1
    on_disk = {name: os.path.getsize(tmp_path / "c" / name) for name in os.listdir(tmp_path / "c") if name != MANIFEST}
    assert manifest["files"] == on_disk and {".metadata", "__0_0.distcp", "trainer.json", "notes.bin"} <= set(on_disk)
    assert (tmp_path / "c" / "trainer.json").read_text() == '{"step": 1}\n'
    assert schedlang.load_checkpoint(tmp_path / "c", MLP(hidden=16, inner=24))["step"] == 1


def test_saving_over_a_checkpoint_replaces_it_whole(tmp_path):
    _saved(tmp_path / "c", seed=0, extra_files={"old.txt": "x"})
    model, _ = _saved(tmp_path / "c", seed=1, step=2)
    assert not (tmp_path / "c" / "old.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["c"]
    fresh = MLP(hidden=16, inner=24)
    assert schedlang.load_checkpoint(tmp_path / "c", fresh)["step"] == 2
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[name], rtol=0, atol=0)


@pytest.mark.parametrize("damage, message", [
    ("missing-data", r"__0_0\.distcp is missing"),
    ("missing-extra", r"trainer\.json is missing"),
    ("truncated-extra", r"trainer\.json has 3 bytes, the manifest says 12"),
    ("grown-data", r"__0_0\.distcp has \d+ bytes, the manifest says \d+"),
    ("changed-metadata", r"\.metadata differs from the one the manifest records"),
    ("unreadable-manifest", r"its manifest\.json cannot be read \(JSONDecodeError"),
])
def test_a_damaged_checkpoint_is_refused_and_nothing_is_loaded(tmp_path, damage, message):
    _saved(tmp_path / "c", extra_files={"trainer.json": '{"step": 1}\n'})
    c = tmp_path / "c"
    if damage == "missing-data":
        os.remove(c / "__0_0.distcp")
    elif damage == "missing-extra":
        os.remove(c / "trainer.json")
    elif damage == "truncated-extra":
        os.truncate(c / "trainer.json", 3)
    elif damage == "grown-data":
        with open(c / "__0_0.distcp", "ab") as f:
            f.write(b"\0")
    elif damage == "changed-metadata":  # as if another save's .metadata had been copied in: its digest differs
        manifest = json.loads((c / MANIFEST).read_text())
        manifest["metadata_sha256"] = "0" * 64
        (c / MANIFEST).write_text(json.dumps(manifest))
    elif damage == "unreadable-manifest":
        (c / MANIFEST).write_text('{"files": ')
    torch.manual_seed(5)
    model = MLP(hidden=16, inner=24)
    before = _params(model)
    with pytest.raises(CheckpointDamagedError) as e:
        schedlang.load_checkpoint(c, model)
    assert str(e.value).startswith(f"load_checkpoint: {str(c)!r} is not a complete checkpoint: ")
    assert re.search(message, str(e.value)), str(e.value)
    assert str(e.value).endswith("or load an earlier checkpoint; nothing was loaded")
    assert isinstance(e.value, schedlang.CheckpointError) and isinstance(e.value, ValueError)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("files, message", [
    ({"sub/x.txt": "x"}, r"extra_files: 'sub/x\.txt' is not a valid name: give a plain file name \(no directory\), "
                         r"other than \.metadata, manifest\.json and \*\.distcp, which the checkpoint uses"),
    ({"manifest.json": "{}"}, r"extra_files: 'manifest\.json' is not a valid name"),
    ({"__0_0.distcp": b""}, r"extra_files: '__0_0\.distcp' is not a valid name"),
    ({"a.txt": 5}, r"extra_files\['a\.txt'\] must be str or bytes, got int"),
    (["a.txt"], r"extra_files must be a dict of file name -> str or bytes, got list"),
])
def test_extra_files_must_be_plain_names_and_contents(tmp_path, files, message):
    with pytest.raises(schedlang.CheckpointError, match="^save_checkpoint: " + message):
        schedlang.save_checkpoint(tmp_path / "c", MLP(), extra_files=files)
    assert not os.listdir(tmp_path)


# ---------------------------------------------------------------------------------------------- interrupted saves
_CHILD = textwrap.dedent("""
    import os, sys, time
    import torch
    import schedlang
    from tests.helpers.models import MLP

    root, stop = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = MLP(hidden=16, inner=24)
    # named and laid out as the trainer's checkpoints are (a trainer state beside the shards)
    schedlang.save_checkpoint(os.path.join(root, "step-00000001"), model, step=1,
                              extra_files={"trainer.json": '{"step": 1}'})   # complete
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if stop.startswith("write"):  # the ranks' data written, .metadata not yet: DCP syncs each file it wrote
        def hold(fd):
            open(os.path.join(root, "held"), "w").close()
            time.sleep(600)
        os.fsync = hold
    else:                    # everything written and the manifest too; the rename not done
        replace = os.replace
        def hold(src, dst):
            if str(src).endswith(".partial"):
                open(os.path.join(root, "held"), "w").close()
                time.sleep(600)
            return replace(src, dst)
        os.replace = hold
    target = "step-00000001" if stop.endswith("-over") else "step-00000002"
    schedlang.save_checkpoint(os.path.join(root, target), model, step=2, extra_files={"trainer.json": '{"step": 2}'})
    print("the save finished: the test did not hold it", file=sys.stderr)
""")


@pytest.mark.parametrize("stop", ["write", "rename", "write-over", "rename-over"])
def test_a_save_killed_midway_never_becomes_a_checkpoint(tmp_path, stop):
    from schedlang.train.checkpoints import latest_checkpoint
    from schedlang.train.resume import clear_interrupted_saves

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), stop], env=env, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.monotonic() + 120
    try:
        while not (tmp_path / "held").exists():
            assert child.poll() is None, f"the child ended before the save was held: {child.stderr.read()}"
            assert time.monotonic() < deadline, "the child did not reach the point where it is killed"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
    target = tmp_path / ("step-00000001" if stop.endswith("-over") else "step-00000002")
    assert os.path.isdir(staging_path(str(target)))  # what the killed save left
    if stop == "write-over":  # the checkpoint it was replacing is untouched
        assert schedlang.load_checkpoint(target, MLP(hidden=16, inner=24))["step"] == 1
    elif stop == "rename-over":  # killed between renaming the old one aside and the new one into place
        assert not target.exists()
        with pytest.raises(CheckpointDamagedError, match=rf"'{target}' is not a complete checkpoint: a save over it "
                                                         r"was cut off between its renames; the checkpoint it "
                                                         rf"replaced is whole in '{target}\.replaced'"):
            schedlang.load_checkpoint(target, MLP(hidden=16, inner=24))
    else:
        assert not target.exists()
        with pytest.raises(CheckpointDamagedError, match=rf"'{target}' is not a complete checkpoint: only "
                                                         rf"'{target}\.partial' exists, the directory of a save that "
                                                         r"did not finish"):
            schedlang.load_checkpoint(target, MLP(hidden=16, inner=24))
    # a restart of the trainer tidies up (the old checkpoint back in place, the staging directory gone) and
    # resumes from the newest complete checkpoint, which holds the first save
    assert clear_interrupted_saves(str(tmp_path)) == [os.path.basename(staging_path(str(target)))]
    assert sorted(os.listdir(tmp_path)) == ["held", "step-00000001"]
    assert latest_checkpoint(str(tmp_path)).name == "step-00000001"
    torch.manual_seed(0)
    first, loaded = MLP(hidden=16, inner=24), MLP(hidden=16, inner=24)
    assert schedlang.load_checkpoint(tmp_path / "step-00000001", loaded)["step"] == 1
    assert all(torch.equal(v, first.state_dict()[k]) for k, v in loaded.state_dict().items())

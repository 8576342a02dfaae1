"""``AsyncCheckpointer``: the state is copied when ``save`` returns, written in the background, and visible
only once complete; a run that goes on changing the model right away saves the values of the save's moment."""

from __future__ import annotations

import os

import pytest
import torch

import schedlang
from schedlang.checkpoint import AsyncCheckpointer
from schedlang.checkpoint.commit import MANIFEST
from tests.helpers.models import MLP


def _trained(seed=0):
    torch.manual_seed(seed)
    model = MLP(hidden=16, inner=24)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    return model, opt


def _async_round_trip(tmp_path, pin_memory):
    model, opt = _trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_avg = {id(p): opt.state[p]["exp_avg"].clone() for p in model.parameters()}
    saver = AsyncCheckpointer(pin_memory=pin_memory)
    pending = saver.save(tmp_path / "step-1", model, opt, step=1, extra={"seed": 0},
                         extra_files={"trainer.json": '{"step": 1}'})
    with torch.no_grad():  # the run goes on at once: the checkpoint must not see this
        for p in model.parameters():
            p.mul_(-3.0)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    saver.wait()
    assert pending.done()
    assert sorted(os.listdir(tmp_path)) == ["step-1"]
    assert {MANIFEST, "trainer.json", ".metadata"} <= set(os.listdir(tmp_path / "step-1"))
    fresh, fresh_opt = _trained(seed=1)
    info = schedlang.load_checkpoint(tmp_path / "step-1", fresh, fresh_opt)
    assert info == {"step": 1, "extra": {"seed": 0}}
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(fresh_opt.state[q]["exp_avg"], expected_avg[id(p)])
    # a second save through the same checkpointer (with pin_memory: into the same host copy)
    saver.save(tmp_path / "step-2", model, opt, step=2)
    saver.wait()
    again = MLP(hidden=16, inner=24)
    assert schedlang.load_checkpoint(tmp_path / "step-2", again)["step"] == 2
    for name, value in again.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


def test_the_saved_state_is_the_one_of_the_save_call(tmp_path):
    _async_round_trip(tmp_path, pin_memory=False)


@pytest.mark.gpu
def test_pinned_host_copy_is_reused_between_saves(tmp_path):
    _async_round_trip(tmp_path, pin_memory=True)


def test_a_failed_background_write_raises_on_wait_and_leaves_no_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    model, opt = _trained()
    saver = AsyncCheckpointer()
    original = dcp.FileSystemWriter.write_data

    def failing(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", failing)
    saver.save(tmp_path / "step-1", model, opt, step=1)
    with pytest.raises(schedlang.CheckpointError, match=r"^save_checkpoint: the asynchronous save of '.*step-1' "
                                                        r"failed \(rank 0: OSError: \[Errno 28\] No space left on device\); '.*step-1\.partial' "
                                                        r"stays incomplete and is never loaded"):
        saver.wait()
    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", original)
    assert not (tmp_path / "step-1").exists()
    saver.wait()  # nothing pending any more

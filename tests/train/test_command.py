"""The trainer's command line: the caching allocator setting it starts CUDA runs with."""

import argparse

import pytest
import torch

from schedlang.train import command


def _ns(device="cuda", dry_run=False):
    return argparse.Namespace(device=device, dry_run=dry_run)


@pytest.fixture
def no_allocator_setting(monkeypatch):
    for name in command.ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    return monkeypatch


def test_a_cuda_run_gets_expandable_segments_where_the_environment_names_no_setting(no_allocator_setting):
    import os

    assert command.prefer_expandable_segments(_ns()) == "expandable_segments:True"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.parametrize("name", command.ALLOCATOR_VARIABLES)
@pytest.mark.parametrize("value", ["expandable_segments:False", "max_split_size_mb:512"])
def test_the_users_allocator_setting_is_left_as_it_is(no_allocator_setting, name, value):
    import os

    no_allocator_setting.setenv(name, value)
    assert command.prefer_expandable_segments(_ns()) is None
    assert os.environ[name] == value
    assert [v for v in command.ALLOCATOR_VARIABLES if v in os.environ] == [name]


@pytest.mark.parametrize("ns", [_ns(device="cpu"), _ns(dry_run=True)], ids=["cpu", "dry-run"])
def test_nothing_is_set_for_a_cpu_run_or_a_dry_run(no_allocator_setting, ns):
    import os

    assert command.prefer_expandable_segments(ns) is None
    assert not any(v in os.environ for v in command.ALLOCATOR_VARIABLES)


def test_a_dry_run_that_runs_its_rank_on_the_gpu_gets_them_as_the_run_would(no_allocator_setting):
    import os

    ns = _ns(dry_run=True)
    ns.trace_memory = "gpu"
    assert command.prefer_expandable_segments(ns) == "expandable_segments:True"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    ns.trace_memory = "fake"  # the fake-tensor trace starts no CUDA
    no_allocator_setting.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert command.prefer_expandable_segments(ns) is None


def test_a_process_whose_cuda_is_started_keeps_its_allocator(no_allocator_setting):
    import os

    no_allocator_setting.setattr(torch.cuda, "is_initialized", lambda: True)
    assert command.prefer_expandable_segments(_ns()) is None
    assert not any(v in os.environ for v in command.ALLOCATOR_VARIABLES)


def test_the_command_sets_it_before_it_checks_the_flags(no_allocator_setting, capsys):
    """main() makes the setting first: the --nproc ranks it spawns and every CUDA use after it see it. Here,
    without a GPU, the run then stops at its check of the device."""
    import os

    status = command.main(["--model", "llama", "--config", "tiny", "--device", "cuda", "--steps", "1"])
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True"
    if not torch.cuda.is_available():
        assert status == 2 and "cuda" in capsys.readouterr().err

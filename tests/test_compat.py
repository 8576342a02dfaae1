"""The declared minimum versions, the oldest-versions CI lane and ``schedlang.compat`` agree, and the installed
torch has what schedlang calls without a version check (checked on every lane: the main one with the newest
torch, the oldest-versions one with the declared minimum)."""

from __future__ import annotations

import inspect
import os
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from schedlang import compat
from tests.helpers.dependencies import declared_requirements

ROOT = Path(__file__).resolve().parent.parent


def _oldest_pins():
    pins = {}
    for line in (ROOT / "ci" / "constraints-oldest.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            pins[requirement.name.lower().replace("_", "-")] = requirement
    return pins


@pytest.mark.parametrize("package, minimum", [("torch", compat.MIN_TORCH), ("transformers", compat.MIN_TRANSFORMERS)])
def test_pyproject_declares_the_minimums_the_oldest_lane_installs(package, minimum):
    floor = f"{minimum[0]}.{minimum[1]}"
    declared = [r for r in declared_requirements() if r.name == package]
    assert declared, f"pyproject.toml does not declare {package}"
    for requirement in declared:  # the dependency and every extra naming it: the same floor
        assert str(requirement.specifier) == f">={floor}", (str(requirement), floor)
    (pin,) = [Version(spec.version) for spec in _oldest_pins()[package].specifier]
    assert compat.release(str(pin)) == minimum, (package, str(pin), minimum)


@pytest.mark.skipif(not os.environ.get("SCHEDLANG_REQUIRE_OLDEST"), reason="the oldest-versions lane checks its own "
                    "install (SCHEDLANG_REQUIRE_OLDEST=1, set by ci/test-oldest.sh)")
def test_the_oldest_lane_runs_on_the_pinned_oldest_versions():
    wrong = []
    for name, pin in _oldest_pins().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            wrong.append(f"{name} is not installed (pinned {pin.specifier})")
            continue
        if not pin.specifier.contains(Version(installed), prereleases=True):
            wrong.append(f"{name} {installed} (pinned {pin.specifier})")
    assert not wrong, wrong
    assert compat.TORCH == compat.MIN_TORCH and compat.TRANSFORMERS == compat.MIN_TRANSFORMERS


@pytest.mark.parametrize("version, release", [("2.13.0+cpu", (2, 13)), ("2.8.0", (2, 8)), ("5.24.0", (5, 24)),
                                              ("2.14.0.dev20261101+cu130", (2, 14)), ("2.9.1a0", (2, 9))])
def test_release_reads_major_and_minor(version, release):
    assert compat.release(version) == release


def test_release_refuses_what_is_no_version():
    with pytest.raises(ValueError, match=r"cannot read a release from the version 'nightly'"):
        compat.release("nightly")


# ------------------------------------------------------------------------------------------------ feature names
def test_traced_collectives_flag_follows_the_release():
    assert compat.TRACED_COLLECTIVES_KEEP_BACKWARD == (compat.TORCH >= (2, 13))


def test_what_every_supported_torch_has():
    """The public APIs schedlang calls without a version check exist on the installed torch."""
    import torch
    import torch.distributed.checkpoint as dcp
    import torch.distributed.pipelining as pipelining
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401  (public FSDP2)
    from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: F401  (public DTensor)
    from torch.distributed.tensor.placement_types import _StridedShard  # noqa: F401  (FSDP2 over TP shards)

    assert "no_dist" in inspect.signature(dcp.save).parameters and "no_dist" in inspect.signature(dcp.load).parameters
    assert {"process_group", "no_dist"} <= set(inspect.signature(dcp.async_save).parameters)
    from torch.distributed._composable.replicate_with_fsdp import replicate  # data parallel's, FSDP-based

    assert "mesh" in inspect.signature(replicate).parameters
    for schedule in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        assert "scale_grads" in inspect.signature(getattr(pipelining, schedule).__init__).parameters, schedule
    assert "src_data_rank" in inspect.signature(distribute_tensor).parameters
    torch._foreach_norm([torch.ones(2)], 2, dtype=torch.float32)  # the trainer's one-pass gradient norm

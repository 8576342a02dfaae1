"""The README's test command, the CI script and the pinned versions agree, so a fresh machine installs
what CI tested. Under CI (``SCHEDLANG_REQUIRE_PINNED=1``, set by ci/test.sh) the installed versions are
checked against the pins too."""

import os
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version
from tests.helpers.dependencies import declared_requirements

ROOT = Path(__file__).resolve().parent.parent


def _pins():
    pins = {}
    for line in (ROOT / "ci" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            pins[requirement.name.lower().replace("_", "-")] = requirement
    return pins


def _readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("pip install") and "pytest" in line]
    assert len(commands) == 1, commands
    return commands[0]


def test_the_readme_and_ci_install_the_same_extras_with_the_same_constraints():
    readme_install = _readme_test_command().split("&&")[0]
    ci_script = (ROOT / "ci" / "test.sh").read_text()
    ci_install = next(line for line in ci_script.splitlines() if "pip install" in line and "-e" in line)
    for part in ('torch==2.13.0', '-e ".[test,docs]"', "-c ci/constraints.txt"):
        assert part in readme_install, (part, readme_install)
        assert part in ci_install, (part, ci_install)
    assert "python -m pytest -q" in _readme_test_command()


def test_every_pin_is_allowed_by_the_declared_dependencies():
    pins = _pins()
    checked = 0
    for declared in declared_requirements():
        pin = pins.get(declared.name.lower().replace("_", "-"))
        if pin is None:
            continue
        (version,) = [Version(spec.version) for spec in pin.specifier]
        assert declared.specifier.contains(version, prereleases=True), (str(declared), str(pin))
        checked += 1
    assert checked >= 8  # torch, transformers, torchao, pytest ... are all pinned


@pytest.mark.skipif(not os.environ.get("SCHEDLANG_REQUIRE_PINNED"), reason="CI checks the installed versions "
                    "(SCHEDLANG_REQUIRE_PINNED=1); a developer's environment may differ")
def test_ci_runs_on_the_pinned_versions():
    wrong = []
    for name, pin in _pins().items():
        if pin.marker is not None and not pin.marker.evaluate():
            continue
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # an extra this run did not install
        if not pin.specifier.contains(Version(installed), prereleases=True):
            wrong.append(f"{name} {installed} (pinned {pin.specifier})")
    assert not wrong, wrong


# ---------------------------------------------------------------------------------------------- the newest lane
NEWEST_LANE = ROOT / "ci" / "test-newest.sh"


def _pip_install_commands(script: Path):
    """Each ``pip install`` command of a shell script, its continued lines joined."""
    text = script.read_text().replace("\\\n", " ")
    return [line for line in text.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]


def _shell_array(script: Path, name: str):
    """The words of a bash array assignment ``name=(...)`` in ``script``, quotes stripped."""
    text = script.read_text()
    start = text.index(f"{name}=(") + len(name) + 2
    return [w.strip('"') for w in text[start:text.index(")", start)].split()]


def test_the_newest_lane_installs_the_newest_releases_with_no_constraints():
    commands = _pip_install_commands(NEWEST_LANE)
    assert commands, "ci/test-newest.sh installs nothing"
    for command in commands:
        words = command.split()
        # a constraints or requirements file, here or in the environment, would pin the lane without anyone seeing
        assert not {"-c", "--constraint", "-r", "--requirement"} & set(words), command
        assert "constraints" not in command and "PIP_CONSTRAINT" not in NEWEST_LANE.read_text(), command
    packages = _shell_array(NEWEST_LANE, "packages")
    assert packages[:2] == ["-e", ".[hf]"], packages
    # nothing beside torch is named with a version: whatever is newest
    assert not [w for w in packages if any(c in w for c in "=<>")], packages
    for package in ("transformers", "tokenizers", "huggingface_hub", "torchao", "safetensors", "pytest"):
        assert package in packages, (package, packages)
    installs = [c for c in commands if '"${packages[@]}"' in c]
    assert len(installs) == 2, installs
    newest, fallback = installs
    # torch unpinned, with no pip configuration file read: the machine's cap and local build do not stand in
    assert "PIP_CONFIG_FILE=/dev/null" in newest and "--upgrade" in newest.split(), newest
    assert "torch" in newest.split() and "torch==" not in newest, newest
    # only where PyPI cannot be reached: the local build, said out loud
    assert newest.lstrip().startswith("if !") and '"torch==2.13.0"' in fallback, fallback
    assert "WARNING: could not install the newest torch" in NEWEST_LANE.read_text()


def _run_ci_with_stub_lanes(tmp_path, codes):
    """.ci/run with each lane replaced by a stub exiting with its code: the lanes it ran, and its output."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "ci").mkdir()
    for name, code in codes.items():
        (tmp_path / "ci" / name).write_text(f"echo ran {name} >> lanes.txt\nexit {code}\n")
    env = {**os.environ, "SCHEDLANG_CI_VENV": str(tmp_path / "venv")}
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    return (tmp_path / "lanes.txt").read_text().split("\n")[:-1], done


LANES = ("test.sh", "docs.sh", "test-oldest.sh", "test-newest.sh")


@pytest.mark.parametrize("failing", ["docs.sh", "test-newest.sh"])
def test_ci_runs_every_lane_and_fails_when_only_one_fails(tmp_path, failing):
    """The main suite, the executed docs build, the oldest and the newest lane all run, whichever fails; CI
    reports each exit code and fails on any."""
    ran, done = _run_ci_with_stub_lanes(tmp_path, {name: 3 if name == failing else 0 for name in LANES})
    assert done.returncode != 0, done.stdout + done.stderr
    assert ran == [f"ran {name}" for name in LANES]
    codes = {name: 3 if name == failing else 0 for name in LANES}
    assert (f"ci: main suite exit {codes['test.sh']}, docs exit {codes['docs.sh']}, oldest-versions lane exit "
            f"{codes['test-oldest.sh']}, newest-releases lane exit {codes['test-newest.sh']}"
            in done.stdout.splitlines()), done.stdout


def test_ci_passes_when_every_lane_passes(tmp_path):
    ran, done = _run_ci_with_stub_lanes(tmp_path, {name: 0 for name in LANES})
    assert done.returncode == 0, done.stdout + done.stderr
    assert ran == [f"ran {name}" for name in LANES]


def _installed_release(name):
    return Version(metadata.version(name)).release


@pytest.mark.skipif(not os.environ.get("SCHEDLANG_REQUIRE_NEWEST"), reason="the newest-releases lane checks its own "
                    "install (SCHEDLANG_REQUIRE_NEWEST=1, set by ci/test-newest.sh)")
def test_the_newest_lane_runs_on_releases_no_older_than_the_pins():
    older = []
    for name in ("transformers", "tokenizers", "huggingface-hub", "safetensors", "torchao", "torch"):
        (pinned,) = [Version(spec.version) for spec in _pins()[name].specifier]
        if _installed_release(name) < pinned.release:
            older.append(f"{name} {metadata.version(name)} (pinned {pinned})")
    assert not older, older

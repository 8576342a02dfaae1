"""The README's test command, the CI script and the pinned versions agree, so a fresh machine installs
what CI tested. Under CI (``SCHEDLANG_REQUIRE_PINNED=1``, set by ci/test.sh) the installed versions are
checked against the pins too."""

import os
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

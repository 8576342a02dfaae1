"""What pyproject.toml declares: every requirement of the package and its extras (read by the CI set-up and
version tests)."""

from pathlib import Path
from typing import List

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def declared_requirements() -> List[Requirement]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines.extend(extra)
    return [Requirement(line) for line in lines]

"""README.md is a front page that holds: short, every link it gives leads somewhere, and its example runs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_it_stays_a_front_page():
    assert len(README.splitlines()) < 200, "long explanations belong in docs/guide/*.rst"


def test_every_relative_link_leads_to_a_file_and_every_anchor_to_a_section():
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    relative = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert relative, "the README links to the docs pages"
    for link in relative:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README links to {link}, which does not exist"
        if anchor:  # an rst section title becomes its lower-cased, dashed id
            titles = re.findall(r"^(.+)\n[-=~^]{3,}$", target.read_text(), flags=re.M)
            ids = {re.sub(r"[^a-z0-9]+", "-", t.lower()).strip("-") for t in titles}
            assert anchor in ids, f"README links to {link}: no such section in {path} ({sorted(ids)})"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(blocks) == 1, "the README shows one example schedule"
    return blocks[0]


def test_the_example_is_short():
    assert len(_example().splitlines()) <= 25


@pytest.mark.slow
def test_the_example_runs_and_prints_its_plan(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_example())
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = result.stdout
    assert "Plan (4 steps)" in plan, plan
    for step in ("checkpoint  0", "decompose   1.up", "trace       1", "fuse        1"):
        assert step in plan, plan

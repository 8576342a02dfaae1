"""Every tutorial runs as a plain script (CI runs them all; Sphinx-gallery renders the same files)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TUTORIALS = sorted((Path(__file__).resolve().parent.parent / "tutorials").glob("[0-9][0-9]_*.py"))


def test_there_are_tutorials():
    assert TUTORIALS, "tutorials/ holds no numbered scripts"


@pytest.mark.parametrize("script", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs_as_a_script(script):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")
    # the timeout only catches a hang: 06 starts two, then four ranks, slow where CPUs are shared
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env,
                            cwd=script.parent.parent)
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), f"{script.name} printed nothing"

import subprocess
import sys

import pytest

from schedlang import cli


def test_demo_single_process_prints_tree_plan_verification_and_table(capsys):
    assert cli.main(["demo", "--layers", "2", "--hidden", "32", "--batch", "2", "--seq", "16", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "== The model (unchanged user code) ==" in out and "TinyTransformer(" in out
    assert "Plan (2 steps)" in out and "checkpoint  blocks.1" in out
    assert "Verify passed" in out
    lines = [l for l in out.splitlines() if l.startswith(("eager ", "scheduled "))]
    assert len(lines) == 2 and "1.00x" in lines[0]


def test_demo_world_size_two_shows_tensor_parallelism(capsys):
    assert cli.main(["demo", "--world-size", "2", "--device", "cpu", "--layers", "1", "--hidden", "32", "--batch", "2", "--seq", "8",
                     "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 ranks (gloo)" in out and "Verify passed" in out
    assert "shard" in out and "sync" in out and "out_features=64" in out
    assert "tensor parallel over 2 ranks" in out


@pytest.mark.parametrize("argv,message", [
    (["demo", "--world-size", "3"], "--world-size must divide 4 (1, 2 or 4), got 3"),
    (["demo", "--hidden", "30"], "--hidden must be divisible by the 4 attention heads, got 30"),
    (["demo", "--world-size", "0"], "--world-size must be at least 1"),
])
def test_demo_bad_arguments(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_primitives_command_and_console_script(capsys):
    assert cli.main(["primitives"]) == 0
    assert "shard" in capsys.readouterr().out.split()
    result = subprocess.run([sys.executable, "-m", "schedlang.cli", "primitives"], capture_output=True, text=True)
    assert result.returncode == 0 and "sync" in result.stdout


def test_bench_unknown_name(capsys):
    code = cli.main(["bench", "no_such_benchmark"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no_such_benchmark" in err or "no benchmarks found" in err

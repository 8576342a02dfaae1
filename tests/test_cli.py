import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from schedlang import cli

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--batch", "2", "--seq", "32", "--repeats", "1"]


def _table(out):
    """{row name: {"ms", "speed", "params"}} of the demo's closing table (columns: step ms, tokens/s,
    speed, params/rank and, where measured, peak MiB)."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^((?:original|schedlang).*?)\s+([\d.]+)\s+[\d,]+\s+([\d.]+)x\s+([\d,]+)(?:\s+[\d,]+)?$", line)
        if m:
            rows[m.group(1).strip()] = {"ms": float(m.group(2)), "speed": float(m.group(3)),
                                        "params": int(m.group(4).replace(",", ""))}
    return rows


def _check_speeds(rows):
    """The speed column is the original's step time over each row's, up to the printed rounding
    (step ms to 0.1, speed to 0.01)."""
    original = next(r for name, r in rows.items() if name.startswith("original"))
    for name, row in rows.items():
        ratio = original["ms"] / row["ms"]
        slack = 0.005 + ratio * (0.05 / original["ms"] + 0.05 / row["ms"])
        assert abs(row["speed"] - ratio) <= slack, (name, row, original)


def test_demo_one_process_schedules_verifies_and_compares(capsys):
    assert cli.main(["demo", "--world-size", "1", "--device", "cpu", *TINY]) == 0
    out = capsys.readouterr().out
    assert "an unchanged HuggingFace LLaMA (2 layers, hidden 64" in out
    assert re.search(r"Plan \(4 steps\)", out)  # trace + fuse per layer
    assert "fuse" in out and "SwiGLU" in out and "inductor" in out
    assert "no activation checkpointing" in out
    assert "Verify passed" in out
    rows = _table(out)
    assert set(rows) == {f"original (1 process, {os.cpu_count()} cores)", "schedlang, 1 process"}
    _check_speeds(rows)
    assert rows["schedlang, 1 process"]["params"] == rows[f"original (1 process, {os.cpu_count()} cores)"]["params"]
    assert "schedlang train" in out and "schedlang report" in out


def test_demo_tensor_parallel_over_two_ranks(capsys):
    assert cli.main(["demo", "--world-size", "2", "--device", "cpu", "--no-compile", *TINY]) == 0
    out = capsys.readouterr().out
    assert "then 2 local ranks (gloo)" in out and "Verify passed" in out
    assert "shard" in out and "sync" in out and "tensor parallel over 2 ranks: 2 attention heads" in out
    rows = _table(out)
    assert "schedlang, tensor parallel over 2 ranks" in rows and len(rows) == 3
    _check_speeds(rows)
    # parameters per rank: about half of the original's (norms are replicated)
    original = next(r["params"] for name, r in rows.items() if name.startswith("original"))
    assert 0.45 * original < rows["schedlang, tensor parallel over 2 ranks"]["params"] < 0.55 * original


@pytest.mark.parametrize("argv,message", [
    (["demo", "--world-size", "3"], "--world-size must divide 4 (1, 2 or 4), got 3"),
    (["demo", "--hidden", "30"], "--hidden must be divisible by the 8 attention heads, got 30"),
    (["demo", "--world-size", "0"], "--world-size must be at least 1, got 0"),
    (["demo", "--heads", "6", "--hidden", "60"], "--heads must be a multiple of the demo model's 4 key/value heads"),
    (["demo", "--seq", "0"], "--seq must be at least 1, got 0"),
    (["demo", "--heads", "0"], "--heads must be at least 1, got 0"),
    (["demo", "--heads", "-4"], "--heads must be at least 1, got -4"),
    (["demo", "--hidden", "0"], "--hidden must be at least 1, got 0"),
    (["demo", "--intermediate", "-5"], "--intermediate must be at least 1"),
    (["report", "--heads", "0"], "--heads must be at least 1, got 0"),
    (["report", "--plan", "no_such_plan.json"], "no_such_plan.json"),
])
def test_bad_arguments(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_report_of_a_saved_plan_on_a_named_model(tmp_path, capsys):
    import schedlang
    from schedlang.models import shard_model  # noqa: F401  (the plan below is model-independent)

    model = cli._model_for_plan("llama-tiny")
    sch = schedlang.create_schedule(model)
    sch["model.layers.0"].checkpoint()
    sch["model.layers.1.mlp"].trace(flatten=True)
    plan = tmp_path / "plan.json"
    plan.write_text(sch.plan.to_json())
    out = tmp_path / "page.html"
    assert cli.main(["report", "--plan", str(plan), "--model", "llama-tiny", "--out", str(out)]) == 0
    page = out.read_text()
    assert "model.layers.1.mlp" in page and "checkpoint" in page and "<svg" in page
    assert cli.main(["report", "--plan", str(plan), "--model", "nope", "--out", str(out)]) == 2
    assert "--model 'nope' is not known: valid are llama-tiny, gpt2-tiny, demo" in capsys.readouterr().err
    json.loads(plan.read_text())  # the plan file itself is left as it was


def test_primitives_command_and_console_script(capsys):
    assert cli.main(["primitives"]) == 0
    listed = capsys.readouterr().out.split()
    import schedlang

    assert listed == list(schedlang.list_primitives()) and "shard" in listed
    result = subprocess.run([sys.executable, "-m", "schedlang.cli", "primitives"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.split() == listed


def test_bench_unknown_name(capsys):
    code = cli.main(["bench", "no_such_benchmark"])
    assert code == 2
    err = capsys.readouterr().err
    # the benchmarks of this checkout's bench/ are offered, by the names the command takes
    bench = Path(__file__).resolve().parents[1] / "bench"
    names = sorted(p.stem[len("bench_"):] for p in bench.glob("bench_*.py"))
    assert names and "fusion" in names
    assert f"unknown benchmark(s) no_such_benchmark; available: {', '.join(names)}\n" in err

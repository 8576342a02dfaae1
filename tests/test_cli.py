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
    """{row name: {"ms", "speed", "params"}} of the demo's closing table (columns: step ms, spread,
    tokens/s, speed, params/rank and, where measured, peak MiB)."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^((?:original|schedlang).*?)\s+([\d.]+)\s+(?:[\d.]+-[\d.]+|n/a)\s+[\d,]+\s+~?([\d.]+)x"
                     r"\s+([\d,]+)(?:\s+[\d,]+)?$", line)
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
    out, err = capsys.readouterr()
    # what runs is said while it runs (on stderr); the results come at the end (on stdout)
    assert "schedlang demo: timing 1 training steps of the original model ...\n" in err
    assert "schedlang demo: scheduling, verifying, building and compiling it in one process" in err
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


# ------------------------------------------------------------------------------------------ bad flags
def _exit_code(argv):
    """The exit status of ``schedlang ARGV``: returned, or raised by argparse as SystemExit."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


def _one_line_error(capsys, prefix):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "usage:" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv,message", [
    (["--nproc", "3", "--tp", "3"], "--tp 3 must divide the model's attention heads (4)"),
    (["--pp", "0"], "--pp must be at least 1, got 0"),
    (["--model", "bert"], "--model bert: the presets 'tiny' and '1b' exist for llama, gpt2"),
    (["--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16' (choose from 'fp32', 'bf16')"),
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--init-from", "no/such/dir"], "--init-from 'no/such/dir': no such directory"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["--save-every", "-2", "--checkpoint-dir", "ckpt"], "--save-every must be at least 0, got -2"),
    (["--log-every", "0"], "--log-every must be at least 1, got 0"),
    (["--grad-clip", "-1"], "--grad-clip must be a number >= 0 (0: no clipping), got -1.0"),
    (["--grad-clip", "nan"], "--grad-clip must be a number >= 0 (0: no clipping), got nan"),
    (["--weight-decay", "-0.5"], "--weight-decay must be a number >= 0, got -0.5"),
])
def test_train_bad_flags_read_as_one_line(argv, message, capsys):
    assert _exit_code(["train", "--device", "cpu", *argv]) == 2
    line = _one_line_error(capsys, "schedlang train: error: ")
    assert message in line


def test_train_checkpoint_dir_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    existing = tmp_path / "a_file"
    existing.write_text("")
    assert cli.main(["train", "--device", "cpu", "--steps", "1", "--checkpoint-dir", str(existing)]) == 2
    line = _one_line_error(capsys, "schedlang train: error: ")
    assert f"--checkpoint-dir: {str(existing)!r} is an existing file" in line


def test_train_init_from_checks_name_the_flag(tmp_path, capsys):
    # a directory without weights
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert cli.main(["train", "--device", "cpu", "--init-from", str(tmp_path)]) == 2
    line = _one_line_error(capsys, "schedlang train: error: ")
    assert line.startswith(f"schedlang train: error: --init-from {tmp_path}: the directory holds no .safetensors file")
    # weights of a family that is no causal LM
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    assert cli.main(["train", "--device", "cpu", "--init-from", str(tmp_path)]) == 2
    line = _one_line_error(capsys, "schedlang train: error: ")
    assert (f"--config {tmp_path}: 't5' models have no causal-LM class in transformers (AutoModelForCausalLM), "
            "and schedlang train trains causal language models") in line


def test_train_help_states_each_default_once(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: None)" not in out and "(default: False)" not in out
    assert out.count("(default:") == out.count("(default: ") and "(default: llama)" in out
    assert "--lr LR peak learning rate (default: 0.001)" in out
    assert "--weight-decay WEIGHT_DECAY the optimizer's weight decay (default: 0.1)" in out
    assert "--seed SEED seed of the initial weights" in out


@pytest.mark.parametrize("argv,message", [
    (["report", "--model", "gpt2-tiny"], "--model gpt2-tiny names the model a saved plan is replayed on, so it needs "
                                         "--plan"),
    (["report", "--out", "{tmp}"], "--out '{tmp}' is a directory: give the path of the HTML file to write"),
    (["report", "--out", "{tmp}/file/page.html"], "--out '{tmp}/file/page.html': '{tmp}/file' is a file"),
    (["report", "--plan", "plan.json", "--out", "{tmp}"], "--out '{tmp}' is a directory"),
    (["demo", "--report", "{tmp}"], "--report '{tmp}' is a directory: give the path of the HTML file to write"),
])
def test_report_paths_are_checked_before_any_work(argv, message, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert cli.main(argv) == 2
    line = _one_line_error(capsys, f"schedlang {argv[0]}: ")
    assert message.format(tmp=tmp_path) in line

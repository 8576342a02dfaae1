"""Autotuning with deterministic fake runners (no timings): spaces, the JSON cache, out-of-memory
points, early stopping, the command, and the cost model reaching the best point in fewer trials."""

import json
import textwrap

import pytest

from schedlang.autotune import Database, Space, model_guided_search, grid_search, plot_best_so_far
from schedlang.autotune import transformer_cost_model
from schedlang.autotune.tune import convert_nargs_to_dict


def update_space(args, space):
    bs = space.create_symbol("batch_size", [4, 8, 16, 32])
    space.create_symbol("ckpt_ratio", [0.0, 0.5, 1.0] if bs >= 16 else [0.0])
    space.create_symbol("tp", [1, 2, 4])
    space.create_symbol("fuse", [False, True])
    return space


def test_space_enumerates_dependent_symbols():
    configs = Space().enumerate(update_space)
    assert len(configs) == (2 * 1 + 2 * 3) * 3 * 2
    assert {c["ckpt_ratio"] for c in configs if c["batch_size"] == 4} == {0.0}
    space = update_space(None, Space())
    with pytest.raises(ValueError, match=r"symbol 'batch_size' has no value yet: fix it first "
                                         r"\(candidates \[4, 8, 16, 32\]\)"):
        space["batch_size"].value
    assert not space["batch_size"] > 2  # unfixed symbols compare False


MEMORY_LIMIT = 40e9
MEM, TIME = transformer_cost_model(n_layers=24, hidden=2048, seq_len=1024, vocab=50000, device_memory=MEMORY_LIMIT)


def fake_runner(calls):
    """A deterministic 'training run': throughput from the cost model with a systematic error,
    out of memory above the limit (the real run decides, not the estimate)."""

    def run(config):
        calls.append(config)
        if MEM(config) * 1.05 > MEMORY_LIMIT:
            raise MemoryError("CUDA out of memory (fake)")
        return 1.0 / (TIME(config) * (1.1 if config["tp"] == 4 else 1.0))

    return run


def test_cost_model_reaches_the_best_configuration_in_fewer_trials(tmp_path):
    configs = Space().enumerate(update_space)
    grid_calls, guided_calls = [], []
    grid = grid_search(configs, fake_runner(grid_calls))
    guided = model_guided_search(configs, fake_runner(guided_calls), MEM, TIME, memory_limit=MEMORY_LIMIT,
                                 patience=3)
    assert guided.best_value == pytest.approx(grid.best_value)  # the same optimum ...
    assert guided.best_config == grid.best_config
    assert guided.trials_to_reach(grid.best_value) < grid.trials_to_reach(grid.best_value)
    assert len(guided_calls) < len(grid_calls) == len(configs)  # ... measured with far fewer runs
    assert guided.pruned and all(MEM(c) > MEMORY_LIMIT for c in guided.pruned)
    assert any(v == 0.0 for _, v in grid.trials)  # out-of-memory points count as failed
    table = plot_best_so_far({"grid": grid, "model": guided})
    assert table.splitlines()[0].split() == ["trial", "grid", "model"]
    assert len(table.splitlines()) == len(configs) + 1


def test_results_are_cached_and_early_stopping_stops(tmp_path):
    path = tmp_path / "tune.json"
    configs = [{"batch_size": b} for b in (1, 2, 3, 4, 5, 6)]
    values = {1: 5.0, 2: 7.0, 3: 6.0, 4: 6.5, 5: 1.0, 6: 99.0}
    calls = []
    result = grid_search(configs, lambda c: calls.append(c) or values[c["batch_size"]], Database(str(path)), patience=2)
    assert [c["batch_size"] for c in calls] == [1, 2, 3, 4]  # two trials without improvement after 2
    assert result.best_config == {"batch_size": 2} and result.best_so_far() == [5.0, 7.0, 7.0, 7.0]
    calls.clear()
    again = grid_search(configs[:4], lambda c: calls.append(c) or 0.0, Database(str(path)))
    assert calls == [] and again.best_value == 7.0  # read back from the file
    assert json.loads(path.read_text())['{"batch_size": 2}']["throughput"] == 7.0


def test_other_runner_errors_are_not_swallowed():
    with pytest.raises(ZeroDivisionError):
        grid_search([{"a": 1}], lambda c: 1 / 0)


def test_nargs_become_a_dict():
    assert convert_nargs_to_dict(["model", "--gpus", "8", "--fp16", "--lr", "0.5", "--sizes", "1", "2"]) == \
        {"gpus": 8, "fp16": 1, "lr": 0.5, "sizes": [1, 2], "model": 1}


def test_the_tune_command_runs_a_script_per_configuration(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent('''
        import sys
        bs, ckpt = int(sys.argv[sys.argv.index("--batch-size") + 1]), float(sys.argv[sys.argv.index("--ckpt") + 1])
        if bs > 16 and ckpt < 0.5:
            raise SystemExit("RuntimeError: CUDA out of memory (fake)")
        print(f"samples/sec: {bs * (1.0 - 0.3 * ckpt):.3f}")
    '''))
    (tmp_path / "cfg.py").write_text(textwrap.dedent('''
        def update_space(args, space):
            space.create_symbol("batch_size", [8, 16, 32])
            space.create_symbol("ckpt_ratio", [0.0, 1.0])
            return space
    '''))
    from schedlang.cli import main as cli_main

    rc = cli_main(["tune", "--config", "cfg.py", "--db", "db.json", "train.py", "--batch-size", "batch_size",
                   "--ckpt", "ckpt_ratio"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "best: {'batch_size': 32, 'ckpt_ratio': 1.0} (22.400 samples/s) after 6 trials" in out
    assert len(json.loads((tmp_path / "db.json").read_text())) == 6

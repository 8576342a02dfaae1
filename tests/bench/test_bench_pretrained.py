"""bench/bench_pretrained.py --tiny: the benchmark's code path on 2 CPU ranks (no timings checked)."""

import json


def test_tiny_run_loads_the_checkpoint_and_profiles_the_build(bench, tmp_path):
    pretrained = bench("bench_pretrained")
    rows = pretrained.main(["--tiny", "--variants", "schedlang-build-pretrained", "--dir", str(tmp_path / "ckpt"),
                            "--results-dir", str(tmp_path), "--profile", str(tmp_path / "profile"), "--rounds", "2", "--warmup-rounds", "1"])
    (row,) = rows
    assert row["check"] == "ok (anchor)" and row["load_s"] > 0 and row["first_loss"] > 0
    # an untimed first run, then two rounds in fresh processes, the row's figure their median
    assert row["rounds"] == 2 and len(row["time_to_first_step_s_rounds"]) == 2
    assert row["first_run_time_to_first_step_s"] > 0
    assert min(row["load_s_rounds"]) <= row["load_s"] <= max(row["load_s_rounds"])
    data = json.loads(next(tmp_path.glob("*pretrained-tiny.json")).read_text())
    assert data["rows"][0]["variant"] == "schedlang-build-pretrained"
    load = (tmp_path / "profile" / "schedlang-build-pretrained-load.txt").read_text()
    assert "cumulative" in load and "build" in load  # schedlang.build is among the costliest calls
    assert "tottime" in load or "internal time" in load  # and by own time
    assert (tmp_path / "profile" / "schedlang-build-pretrained-first-step.txt").is_file()


def test_profile_names_keep_to_safe_characters(bench, tmp_path):
    pretrained = bench("bench_pretrained")
    assert pretrained._profiled(str(tmp_path), "from_pretrained+parallelize_module-load", lambda: 7) == 7
    assert (tmp_path / "from_pretrained_parallelize_module-load.txt").is_file()


def test_median(bench):
    pretrained = bench("bench_pretrained")
    assert pretrained._median([3.0]) == 3.0
    assert pretrained._median([4.0, 1.0]) == 2.5
    assert pretrained._median([5.0, 1.0, 2.0]) == 2.0


def test_rounds_must_be_positive(bench, capsys):
    import pytest

    pretrained = bench("bench_pretrained")
    with pytest.raises(SystemExit):
        pretrained.main(["--tiny", "--rounds", "0"])
    assert "--rounds must be at least 1 and --warmup-rounds at least 0, got 0 and 1" in capsys.readouterr().err

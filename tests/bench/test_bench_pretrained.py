"""bench/bench_pretrained.py --tiny: the benchmark's code path on 2 CPU ranks (no timings checked)."""

import json


def test_tiny_run_loads_the_checkpoint_and_profiles_the_build(bench, tmp_path):
    pretrained = bench("bench_pretrained")
    rows = pretrained.main(["--tiny", "--variants", "schedlang-build-pretrained", "--dir", str(tmp_path / "ckpt"),
                            "--results-dir", str(tmp_path), "--profile", str(tmp_path / "profile")])
    (row,) = rows
    assert row["check"] == "ok (anchor)" and row["load_s"] > 0 and row["first_loss"] > 0
    data = json.loads(next(tmp_path.glob("*pretrained-tiny.json")).read_text())
    assert data["rows"][0]["variant"] == "schedlang-build-pretrained"
    load = (tmp_path / "profile" / "schedlang-build-pretrained-load.txt").read_text()
    assert "cumulative" in load and "build" in load  # schedlang.build is among the costliest calls
    assert (tmp_path / "profile" / "schedlang-build-pretrained-first-step.txt").is_file()

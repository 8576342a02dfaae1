"""bench/grouped_gemm_probe.py: a tiny layer in the interpreter runs every way and checks it against the family."""

import json

import pytest

pytest.importorskip("transformers")


def test_tiny_run_checks_each_way_and_writes_a_probe_without_rows(bench, tmp_path):
    probe = bench("grouped_gemm_probe")
    out = probe.main(["--tiny", "--results-dir", str(tmp_path)])
    results = out["results"]
    # torch._grouped_mm needs a Hopper GPU: on the CPU only the family's loop and the Triton kernels run
    assert [r["way"] for r in results] == ["family_loop", "triton"]
    assert all(r["check"] == "ok" and r["ms"] > 0 for r in results), results
    (path,) = tmp_path.glob("*-grouped-gemm.json")
    data = json.loads(path.read_text())
    assert data["rows"] == [] and data["gpus"] == 0 and data["probe"]["layer"]["experts"] == probe.TINY["experts"]


def test_a_wrong_way_fails_the_check(bench, monkeypatch):
    probe = bench("grouped_gemm_probe")
    grouped = probe.grouped_forward
    monkeypatch.setattr(probe, "grouped_forward", lambda *a: grouped(*a) * 1.01)
    out = probe.measure(probe.TINY, __import__("torch").device("cpu"))
    assert [r["check"].split()[:2] for r in out] == [["ok"], ["FAIL", "out"]]

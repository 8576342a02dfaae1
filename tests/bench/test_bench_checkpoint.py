"""bench/bench_checkpoint.py --tiny: the benchmark's code path on the tiny LLaMA on the CPU (no timings checked)."""

import json


def test_tiny_run_writes_a_row_per_variant_and_every_save_is_complete(bench, tmp_path):
    checkpoint = bench("bench_checkpoint")
    rows = checkpoint.main(["--tiny", "--results-dir", str(tmp_path), "--warmup", "1", "--repeats", "2", "--saves", "1",
                            "--steps-between", "1", "--checkpoint-dir", str(tmp_path / "ckpt")])
    (path,) = tmp_path.glob("*-checkpoint-save-tiny.json")
    data = json.loads(path.read_text())
    for key in ("git_sha", "date", "device", "gpus", "torch", "triton", "transformers", "command"):
        assert key in data, key
    assert data["rows"] == rows
    assert [r["variant"] for r in rows] == ["no-save", "sync-save", "async-save", "async-save-pinned"]
    for r in rows:
        assert r["work"] == "llama-tiny-dp1-save" and r["check"] == "ok", r
        assert r["ms"] > 0 and r["layout"] == "pp=1 dp=1 tp=1"
    for r in rows[1:]:
        assert r["save_ms"] > 0 and r["write_s"] > 0 and r["checkpoint_gib"] > 0
        assert r["role"] == ("baseline" if r["variant"] == "sync-save" else "schedlang")
    assert not list((tmp_path / "ckpt").iterdir())  # each checkpoint removed after it was checked

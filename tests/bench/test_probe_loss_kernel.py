"""bench/probe_loss_kernel.py: a tiny run in the interpreter checks every launch shape it times."""

import json


def test_tiny_run_checks_each_launch_shape_and_writes_a_probe_without_rows(bench, tmp_path):
    probe = bench("probe_loss_kernel")
    out = probe.main(["--tiny", "--results-dir", str(tmp_path)])
    results = out["results"]
    slices = [v // 2 for v in probe.TINY_VOCABS]
    # each width in contiguous rows, then in padded rows where padding changes the stride (128 needs none)
    widths = [("whole", v) for v in probe.TINY_VOCABS] + [("sliced", v) for v in slices]
    assert slices == [50, 128]
    strides = {100: [100, 112], 257: [257, 272], 50: [50, 64], 128: [128]}
    assert [(r["path"], r["vocab"], r["row_stride"]) for r in results if r["launch"] == "default"] == [
        (path, vocab, stride) for path, vocab in widths for stride in strides[vocab]]
    assert [r["rows_aligned"] for r in results if r["launch"] == "default"] == [
        stride * 2 % 16 == 0 for _, vocab in widths for stride in strides[vocab]]
    for path, vocab in widths:
        for stride in strides[vocab]:
            launches = [r["launch"] for r in results if (r["path"], r["vocab"], r["row_stride"]) == (path, vocab, stride)]
            assert launches == ["default", "v128-w4-m1", "v64-w4-m2"]
    assert all(r["check"] == "ok" and r["ms"] > 0 for r in results), results
    (path,) = tmp_path.glob("*-probe-loss-kernel.json")
    data = json.loads(path.read_text())
    # no rows and no GPU, so that the README's tables never take the probe for a timing
    assert data["rows"] == [] and data["gpus"] == 0 and len(data["probe"]["results"]) == len(results)


def test_a_wrong_gradient_fails_the_check(bench, monkeypatch):
    probe = bench("probe_loss_kernel")
    expected = probe._expected

    def off_by_a_little(logits, target):
        loss, grad = expected(logits, target)
        return loss, grad + 1e-2

    monkeypatch.setattr(probe, "_expected", off_by_a_little)
    import torch

    for path in ("whole", "sliced"):
        for padded in (False, True):
            (row, *_) = probe.measure(probe.TINY_ROWS, 100, (), torch.device("cpu"), path=path, padded=padded)
            assert row["launch"] == "default" and row["check"].startswith("FAIL")
            assert row["row_stride"] == (112 if padded else 100)

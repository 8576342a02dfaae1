"""bench/probe_grad_direction.py --tiny: right and wrong first steps against the gradient-direction bounds."""

import json


def test_wrong_labels_fall_far_below_the_bounds_and_the_eager_step_meets_itself(bench, tmp_path):
    probe = bench("probe_grad_direction")
    row = probe.main(["--tiny", "--results-dir", str(tmp_path)])
    cases, bounds = row["cosine_with_eager"], row["bounds"]
    assert cases["eager"] >= bounds["fp32"]  # the same fp32 step on the CPU is deterministic
    # every wrong step is below even the loosest bound (float8's), with room to spare
    for name in ("unshifted", "shifted-by-2", "permuted-rows"):
        assert cases[name] < bounds["float8"] - 0.1, (name, cases[name])
    (path,) = tmp_path.glob("*-grad-direction.json")
    data = json.loads(path.read_text())
    # no rows, so that the README's tables never take the probe for a timing
    assert data["rows"] == [] and data["probe"] == row and data["gpus"] == 0

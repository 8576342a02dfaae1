"""bench/harness.py: the correctness verdict of a variant, and the rows' ratios."""

import math


def test_check_losses_passes_and_fails(bench):
    h = bench("harness")
    anchor = {"variant": "titan-style", "losses": [10.4, 9.9, 9.5], "grad_norm": 2.0}
    ok = h.check_losses([10.41, 9.91, 9.52], 2.02, 10.4, anchor, h.TOL_BF16)
    assert ok["check"] == "ok" and ok["losses"] == [10.41, 9.91, 9.52]
    bad = h.check_losses([10.9, 9.9, 9.1], 2.5, 10.4, anchor, h.TOL_BF16)
    assert bad["check"] == ("FAIL first loss 10.9000 vs eager 10.4000; grad norm 2.5 vs titan-style 2; "
                            "loss after 3 steps 9.1000 vs titan-style 9.5000")
    nan = h.check_losses([math.nan], 1.0, 10.4, None, h.TOL_FP32)
    assert nan["check"].startswith("FAIL first loss nan vs eager 10.4000") and "non-finite" in nan["check"]


def test_ratio_to_the_named_baseline_else_the_best(bench):
    h = bench("harness")
    rows = [{"work": "w", "variant": "a", "role": "baseline", "tokens_per_s": 100.0},
            {"work": "w", "variant": "b", "role": "baseline", "tokens_per_s": 200.0},
            {"work": "w", "variant": "s", "role": "schedlang", "tokens_per_s": 150.0, "baseline": "a"},
            {"work": "w", "variant": "t", "role": "schedlang", "tokens_per_s": 150.0},
            {"work": "w", "variant": "u", "role": "schedlang", "tokens_per_s": None, "baseline": "a"}]
    assert h.ratio_to_baseline(rows[2], rows) == 1.5
    assert h.ratio_to_baseline(rows[3], rows) == 0.75
    assert h.ratio_to_baseline(rows[4], rows) is None

"""The demo's closing table and the sentence under it, from given step times (no timing is measured here)."""

from schedlang.demo import speed_table, speed_verdict, within_noise

ORIGINAL = "original (1 process, 2 cores)"


def _rows(original, single, tp=None, peak=None):
    rows = [(ORIGINAL, original, 1000, peak), ("schedlang, 1 process", single, 1000, peak)]
    if tp is not None:
        rows.append(("schedlang, tensor parallel over 2 ranks", tp, 520, peak))
    return rows


def test_overlapping_spreads_are_within_noise_and_separate_ones_are_not():
    assert within_noise([10.0, 12.0, 30.0], [11.0, 13.0, 14.0]) is True
    assert within_noise([10.0, 11.0, 12.0], [12.5, 13.0, 14.0]) is False
    assert within_noise([10.0, 11.0], [12.5, 13.0]) is None  # two steps say nothing about the noise


def test_the_table_gives_median_spread_and_marks_speeds_within_noise():
    lines = speed_table(_rows([100.0, 90.0, 110.0], [40.0, 120.0, 60.0], tp=[20.0, 21.0, 22.0]), tokens=1000)
    assert lines[0].split() == ["step", "ms", "spread", "(min-max)", "tokens/s", "speed", "params/rank"]
    assert lines[1].split() == ["original", "(1", "process,", "2", "cores)", "100.0", "90.0-110.0", "10,000", "1.00x",
                                "1,000"]
    # median 60 ms, its steps overlap the original's: the 1.67x is marked as within noise
    assert lines[2].split() == ["schedlang,", "1", "process", "60.0", "40.0-120.0", "16,667", "~1.67x", "1,000"]
    assert lines[3].split()[-5:] == ["21.0", "20.0-22.0", "47,619", "4.76x", "520"]


def test_the_table_shows_peak_memory_where_measured_and_no_spread_for_too_few_steps():
    lines = speed_table(_rows([100.0], [50.0], peak=12.0), tokens=100)
    assert lines[0].split()[-1] == "MiB"
    assert lines[2].split()[-5:] == ["n/a", "2,000", "2.00x", "1,000", "12"]


def test_the_closing_sentence_agrees_with_the_table():
    faster = speed_verdict(_rows([100.0, 90.0, 110.0], [40.0, 120.0, 60.0], tp=[20.0, 21.0, 22.0]), "cpu")
    assert faster.startswith(
        "Against the original's 3 timed steps: schedlang, 1 process: 1.67x, within noise (its steps and the "
        "original's overlap); schedlang, tensor parallel over 2 ranks: 4.76x, faster (its slowest timed step beat "
        "the original's fastest).\nThe ranks share this CPU's cores, so the tensor-parallel row compares two ways "
        "of using the same cores")
    slower = speed_verdict(_rows([10.0, 11.0, 12.0], [20.0, 21.0, 22.0]), "cuda")
    assert slower == ("Against the original's 3 timed steps: schedlang, 1 process: 0.52x, slower (its fastest timed "
                      "step was slower than the original's slowest).")
    assert speed_verdict(_rows([10.0], [5.0]), "cpu") == (
        "Only 1 step of each model timed: too few to tell a difference from noise (run with --repeats 3 or more).")

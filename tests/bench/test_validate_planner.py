"""bench/validate_planner.py: the docs page is the one the newest results generate, each row's error is what
its published and estimated GiB give, and the estimates are those of the planner as it is now."""

import json

import pytest

from .conftest import load_bench


@pytest.fixture(scope="module")
def validate():
    return load_bench("validate_planner")


def test_the_page_is_current(validate):
    assert validate.main(["--check"]) == 0
    page = validate.PAGE.read_text()
    data = json.loads(validate.newest_results().read_text())
    assert validate.render(data) == page
    for row in data["rows"]:
        assert row["name"] in page and f"{row['error_pct']:+.1f}%" in page
        # each published row is traced, or says why not
        assert ("traced_gib" in row["traced"]) != ("skipped" in row["traced"])


def test_a_stale_page_is_refused(validate, tmp_path, monkeypatch, capsys):
    stale = tmp_path / "planner_validation.rst"
    page = validate.PAGE.read_text()
    error = f"{json.loads(validate.newest_results().read_text())['rows'][0]['error_pct']:+.1f}%"
    assert error in page
    stale.write_text(page.replace(error, "+0.1%"))
    monkeypatch.setattr(validate, "PAGE", stale)
    assert validate.main(["--check"]) == 1
    assert "is not current" in capsys.readouterr().err


def test_each_rows_error_is_what_the_json_says_and_the_estimates_are_current(validate):
    data = json.loads(validate.newest_results().read_text())
    assert [r["name"] for r in data["rows"]] == [r["name"] for r in validate.ROWS]
    assert [r["published_gib"] for r in data["rows"]] == [67.0, 71.9, 82.5, 72.7]
    for row, spec in zip(data["rows"], validate.ROWS):
        error = row["estimated_gib"] / row["published_gib"] - 1
        assert row["error_pct"] == pytest.approx(100 * error, abs=0.06)
        assert row["within_tolerance"] == (abs(error) <= validate.TOLERANCE)
        assert bool(row["why_missed"]) == (not row["within_tolerance"])
        # the planner as it is now gives the same estimate (the results are regenerated with the model)
        assert validate.estimate(spec)["peak_gib"] == pytest.approx(row["estimated_gib"], abs=0.01), row["name"]
    assert data["git_sha"] and data["torch"] and data["transformers"]


def test_our_measured_runs_sit_beside_their_estimates_of_today(validate):
    data = json.loads(validate.newest_results().read_text())
    page = validate.PAGE.read_text()
    measured = data["measured"]
    assert measured["rows"], "no measured row"
    for row in measured["rows"]:
        assert row["name"] in page
        assert row["peak_error_pct"] == pytest.approx(100 * (row["estimated_peak_gib"] / row["measured_peak_gib"] - 1),
                                                      abs=0.06)
        assert row["step_error_pct"] == pytest.approx(100 * (row["estimated_step_ms"] / row["measured_step_ms"] - 1),
                                                      abs=0.06)
        # the estimate is the planner's as it is now
        plan = validate.estimate_measured(row["flags"], row["gpus"])
        assert plan["peak_gib"] == pytest.approx(row["estimated_peak_gib"], abs=0.01), row["name"]
        assert plan["step_ms"] == pytest.approx(row["estimated_step_ms"], abs=0.1), row["name"]
    # the layouts no lent machine could run are listed as not measured, not left out
    for name in measured["not_measured"]:
        assert name.split(" (")[0] in page


def test_the_ranks_run_on_one_gpu_sit_beside_the_published_figures(validate):
    """Each row's rank 0 run on one GPU (bench/planner_on_gpu.py): the page shows its reserved peak under each
    allocator setting with the error the published figure gives, from files that exist."""
    data = json.loads(validate.newest_results().read_text())
    rows = data.get("on_gpu", {}).get("rows", [])
    if not rows:
        pytest.skip("no row of the published runs has been run on a GPU yet")
    page = validate.PAGE.read_text()
    published = {r["name"]: r["published_gib"] for r in data["rows"]}
    for row in rows:
        assert (validate.ROOT / row["file"]).is_file()
        if row.get("out_of_memory"):  # the rank needs more than that GPU under that allocator setting
            assert f"out of memory on {row['device']}" in page and "reserved_gib" not in row
            continue
        assert row["published_gib"] == published[row["name"]]
        assert row["reserved_gib"] >= row["allocated_gib"] > 0
        assert row["reserved_error_pct"] == pytest.approx(100 * (row["reserved_gib"] / row["published_gib"] - 1),
                                                          abs=0.06)
        assert f"{row['reserved_gib']:.1f} ({row['reserved_error_pct']:+.1f}%)" in page

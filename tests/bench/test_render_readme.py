"""bench/render_readme.py: the README's headline and the docs' performance page come from the result files, and
only from them; so do the charts, which ``--check`` tells current or stale from their metadata."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

README = """# project

## Performance

intro

<!-- perf-table:start -->
| old | hand-written | 99.5 ms |
<!-- perf-table:end -->

## Layout
"""

PAGE = """Performance
===========

Prose kept as it is.

.. perf-table:start
old generated text
.. perf-table:end

After.
"""


def _write(path, rows, date, sha, gpus=1, device="NVIDIA H100 80GB HBM3"):
    path.write_text(json.dumps({"git_sha": sha, "date": date, "device": device, "gpus": gpus, "torch": "2.11.0",
                                "triton": "3.6.0", "transformers": "5.17.0", "rows": rows}))


def _row(work, variant, role, ms, tokens_per_s, baseline="titan-style", check="ok"):
    return {"work": work, "variant": variant, "role": role, "ms": ms, "tokens_per_s": tokens_per_s, "mfu": 0.5,
            "peak_mem_gib": 30.0, "check": check, "ms_runs": [ms, ms], "baseline": baseline,
            "optimizer": "torch.optim.AdamW(fused=True)"}


def _pages(tmp_path, readme_text=README):
    """A README and a docs page with their markers, and the arguments that point the renderer at them."""
    readme, page = tmp_path / "README.md", tmp_path / "docs" / "performance.rst"
    page.parent.mkdir(exist_ok=True)
    readme.write_text(readme_text)
    page.write_text(PAGE)
    return readme, page, ["--readme", str(readme), "--docs-page", str(page), "--static", str(page.parent / "_static")]


@pytest.fixture
def results(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    # an older run of the same work, which the newer one replaces
    _write(d / "2026-11-20-train.json", [_row("llama-1.1b-1gpu", "titan-style", "baseline", 200.0, 40000.0)],
           "2026-11-20", "0" * 40)
    _write(d / "2026-11-30-train.json", [
        _row("llama-1.1b-1gpu", "titan-style", "baseline", 130.0, 63000.0),
        dict(_row("llama-1.1b-1gpu", "schedlang-optimize", "schedlang", 104.0, 78750.0),
             gpu_clock={"sm_mhz": 1672, "power_w": 655.4, "power_capped": 0.96, "samples": 30,
                                  "energy_j": 2163.0, "j_per_step": 86.52}),
        _row("llama-1.1b-1gpu", "eager", "baseline", 210.0, 39060.0, check="FAIL first loss 9.1 vs eager 10.4"),
    ], "2026-11-30", "abcdef1234567890" + "0" * 24)
    # CPU checks of the script never reach the README
    _write(d / "2026-11-30-train-tiny.json", [_row("gpt2-medium-1gpu", "titan-style", "baseline", 3.0, 900.0)],
           "2026-11-30", "1" * 40, gpus=0, device="cpu")
    (d / "2026-11-21-tp.md").write_text("| LLaMA TP=2 | 99.5 ms (1.35x) |\n")  # hand-written: ignored
    return d


def test_table_from_json_only(bench, results, tmp_path):
    render = bench("render_readme")
    text = render.render_table(render.load_results(results))
    assert "99.5" not in text and "hand-written" not in text
    lines = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| llama-1.1b-1gpu |")}
    assert set(lines) == {"titan-style", "schedlang-optimize", "eager"}
    # the ratio is to the named baseline of the newest file: 78750 / 63000
    assert "| 1.25x titan-style |" in lines["schedlang-optimize"]
    assert "| 1.00x titan-style |" in lines["titan-style"]
    assert "| 0.62x titan-style |" in lines["eager"]
    assert "FAIL first loss 9.1 vs eager 10.4" in lines["eager"]
    for line in lines.values():
        assert "| NVIDIA H100 80GB HBM3 x1 | 2026-11-30 | abcdef1234 |" in line
    # the GPU clock over the timed steps, where the run sampled it
    assert "| ok | 1672 MHz, 655 W, 96% capped, 86.5 J/step | NVIDIA" in lines["schedlang-optimize"]
    assert "| ok | - | NVIDIA" in lines["titan-style"]
    assert "| 104.0 | 78,750 | 50.0% |" in lines["schedlang-optimize"]
    # works without a GPU result say so; the CPU file is not used
    assert "| gpt2-medium-1gpu | no GPU results recorded for the current code yet |" in text
    assert "| llama-1.1b-tp2 | no GPU results recorded for the current code yet |" in text


def test_the_readme_gets_the_headline_and_the_docs_page_every_row(bench, results, tmp_path):
    render = bench("render_readme")
    readme, page, paths = _pages(tmp_path)
    assert render.main(["--results", str(results), *paths, "--no-chart"]) == 0
    text, rst = readme.read_text(), page.read_text()
    assert "99.5" not in text and "hand-written" not in text and "old generated text" not in rst
    # the README: one row per work, the fastest schedlang row against the fastest passing baseline (78750 / 63000);
    # eager is slower and failed its check, and is not the strongest baseline
    rows = [line for line in text.splitlines() if line.startswith("| llama-1.1b-1gpu |")]
    assert rows == ["| llama-1.1b-1gpu | schedlang-optimize | 78,750 | titan-style | 63,000 | 1.25x | "
                    "NVIDIA H100 80GB HBM3 x1 | 2026-11-30 | abcdef1234 |"]
    assert "](docs/performance.rst)" in text
    assert text.startswith("# project\n\n## Performance\n\nintro\n\n<!-- perf-table:start -->")
    assert text.endswith("<!-- perf-table:end -->\n\n## Layout\n")
    # the docs page: its prose kept, every row as a list-table, the failing check and the works without results
    assert rst.startswith("Performance\n===========\n\nProse kept as it is.\n\n.. perf-table:start\n")
    assert rst.endswith(".. perf-table:end\n\nAfter.\n")
    # one table per work, what its rows share said once above it: the run, the optimizer, the baseline of each ratio
    assert ("**llama-1.1b-1gpu**: optimizer torch.optim.AdamW(fused=True), NVIDIA H100 80GB HBM3 x1, 2026-11-30, "
            "abcdef1234\n") in rst
    assert "     - vs baseline (titan-style)\n     - vs fastest baseline (titan-style)\n" in rst
    assert "   * - eager\n     - baseline\n     - 210.0\n" in rst
    assert "     - 0.62x\n     - 0.62x\n     - FAIL first loss 9.1 vs eager 10.4\n" in rst
    # the GPU clock in narrow columns; a row without a sample has none
    assert "     - 1672 MHz\n     - 655 W\n     - 96% capped\n     - 86.5 J/step\n" in rst
    assert "     - ok\n     - \\-\n     - \\-\n     - \\-\n     - \\-\n" in rst
    assert "**gpt2-medium-1gpu**: no GPU results recorded for the current code yet." in rst
    # rendering again changes nothing, and --check agrees; a changed figure on either page fails it
    assert render.main(["--results", str(results), *paths, "--no-chart", "--check"]) == 0
    readme.write_text(text.replace("1.25x", "1.35x"))
    assert render.main(["--results", str(results), *paths, "--no-chart", "--check"]) == 1
    readme.write_text(text)
    page.write_text(rst.replace("210.0", "200.0"))
    assert render.main(["--results", str(results), *paths, "--no-chart", "--check"]) == 1


def test_a_baseline_that_failed_its_check_is_never_the_one_beaten(bench, tmp_path):
    render = bench("render_readme")
    d = tmp_path / "r"
    d.mkdir()
    _write(d / "2026-12-04-train.json", [
        _row("llama-1.1b-tp2", "tp-titan", "baseline", 130.0, 63000.0, baseline="tp-titan"),
        _row("llama-1.1b-tp2", "tp-fast-but-wrong", "baseline", 100.0, 80000.0, check="FAIL loss 1.0 vs 2.0"),
        _row("llama-1.1b-tp2", "schedlang-a", "schedlang", 110.0, 70000.0, baseline="tp-titan"),
        _row("llama-1.1b-tp2", "schedlang-b", "schedlang", 90.0, 90000.0, check="FAIL grad cosine 0.5"),
        _row("llama-1.1b-1gpu-ckpt", "schedlang-optimize", "schedlang", 137.0, 59000.0, baseline="schedlang-optimize"),
    ], "2026-12-04", "7" * 40, gpus=2)
    (headline,) = render.headline_rows(render.load_results(d))  # the ablation without a baseline has none
    assert (headline["work"], headline["variant"], headline["baseline"]) == ("llama-1.1b-tp2", "schedlang-a", "tp-titan")
    assert headline["speedup"] == pytest.approx(70000 / 63000, abs=1e-4)
    assert render.render_headline([]) == ""


def test_cells_read_literally_in_restructuredtext(bench):
    render = bench("render_readme")
    assert render._rst_cell("-") == "\\-"  # not an empty bullet list
    assert render._rst_cell("+6.8%") == "\\+6.8%"
    assert render._rst_cell("1. x") == "\\1. x"  # not an enumerated list
    assert render._rst_cell("1.07x") == "1.07x"
    assert render._rst_cell("eager_reduce | q*k") == "eager\\_reduce \\| q\\*k"
    assert render._rst_cell(None) == "\\-"
    # a flag is a literal, so that Sphinx does not turn its "--" into a dash
    assert render._rst_cell("--dp 2 --dp-mode ddp") == "``--dp`` 2 ``--dp-mode`` ddp"


def test_micro_rows_compare_by_time(bench, results, tmp_path):
    render, harness = bench("render_readme"), bench("harness")
    rows = [harness.micro_row("adamw-445-tensors", "torch fused", "baseline", 2.9),
            harness.micro_row("adamw-445-tensors", "schedlang FusedAdamW", "schedlang", 2.32, baseline="torch fused")]
    _write(results / "2026-12-01-optim.json", rows, "2026-12-01", "2" * 40)
    table = render.render_table(render.load_results(results))
    line = next(x for x in table.splitlines() if "schedlang FusedAdamW" in x)
    assert "| 1.25x torch fused |" in line and "| 2.320 |" in line


def test_charts_are_written_and_checked_from_the_figures_they_carry(bench, results, tmp_path):
    pytest.importorskip("matplotlib")
    render = bench("render_readme")
    readme, page, paths = _pages(tmp_path)
    assert render.main(["--results", str(results), *paths, "--check"]) == 1  # no charts yet
    assert render.main(["--results", str(results), *paths]) == 0
    static = page.parent / "_static"
    headline, every_row = static / "perf_headline.png", static / "perf_all.png"
    for chart in (headline, every_row):
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](docs/_static/perf_headline.png)" in readme.read_text()
    assert ".. image:: _static/perf_headline.png" in page.read_text()
    assert ".. image:: _static/perf_all.png" in page.read_text()
    # the headline chart holds the one bar of the README's row: 78750 / 63000
    bars = json.loads(render.png_text(headline)[render.CHART_KEY])
    assert [b[1] for b in bars] == [1.25] and "schedlang-optimize" in bars[0][0]
    assert render.main(["--results", str(results), *paths, "--check"]) == 0
    # a new result makes the charts stale even where the tables were rendered without them
    _write(results / "2026-12-05-train.json", [_row("llama-1.1b-1gpu", "titan-style", "baseline", 130.0, 63000.0),
                                               _row("llama-1.1b-1gpu", "schedlang-x", "schedlang", 100.0, 81900.0)],
           "2026-12-05", "8" * 40)
    assert render.main(["--results", str(results), *paths, "--no-chart"]) == 0
    assert render.main(["--results", str(results), *paths, "--no-chart", "--check"]) == 0
    assert render.main(["--results", str(results), *paths, "--check"]) == 1
    assert not render.chart_is_current(render.headline_bars(render.load_results(results)), headline)


def test_the_repository_pages_and_charts_are_what_the_results_give(bench):
    """README.md, docs/performance.rst and the charts in docs/_static are current (python bench/render_readme.py)."""
    assert bench("render_readme").main(["--check"]) == 0


def test_missing_markers_are_named(bench, results, tmp_path):
    render = bench("render_readme")
    readme, page, paths = _pages(tmp_path, "# no markers\n")
    with pytest.raises(SystemExit, match="markers <!-- perf-table:start --> ... <!-- perf-table:end --> not found"):
        render.main(["--results", str(results), *paths, "--no-chart"])
    readme.write_text(README)
    page.write_text("Performance\n===========\n")
    with pytest.raises(SystemExit, match="performance.rst: markers .. perf-table:start ... .. perf-table:end not found"):
        render.main(["--results", str(results), *paths, "--no-chart"])


def test_train_works_listed_in_the_renderer_are_the_harness_works(bench):
    assert tuple(bench("bench_train").WORKS) == bench("render_readme").TRAIN_WORKS


def test_profiles_are_rendered_from_rows_that_carry_them(bench, results, tmp_path):
    render = bench("render_readme")
    rows = [_row("llama-1.1b-1gpu", "titan-style", "baseline", 130.0, 63000.0),
            _row("llama-1.1b-1gpu", "schedlang-optimize", "schedlang", 120.0, 68250.0),
            _row("llama-1.1b-1gpu", "eager", "baseline", 210.0, 39060.0)]
    rows[0]["profile"] = {"span_ms": 131.0, "gpu_busy_ms": 125.0, "idle_share": 0.0458, "launches_per_step": 1692.0,
                          "by_kind_ms": {"gemm": 80.0, "optimizer": 13.7, "cast_copy": 1.8}}
    rows[1]["profile"] = {"span_ms": 121.0, "gpu_busy_ms": 119.5, "idle_share": 0.0124, "launches_per_step": 1689.0,
                          "by_kind_ms": {"gemm": 81.0, "optimizer": 13.6, "schedlang": 0.12}}
    _write(results / "2026-12-01-train.json", rows, "2026-12-01", "f" * 40)
    text = render.render_profiles(render.load_results(results))
    assert "| llama-1.1b-1gpu (ms per step) | titan-style | schedlang-optimize |" in text  # eager has none
    assert "| step ms (timed) | 130.0 | 120.0 |" in text
    assert "| GPU idle share | 4.6% | 1.2% |" in text
    assert "| kernel launches | 1,692 | 1,689 |" in text
    # kinds by their largest time; a kind one row lacks is 0 there
    body = text[text.index("| gemm |"):]
    assert body.index("| gemm | 80.0 | 81.0 |") < body.index("| optimizer | 13.7 | 13.6 |") < body.index(
        "| cast_copy | 1.8 | 0.0 |") < body.index("| schedlang | 0.0 | 0.1 |")
    # the docs page shows the same as a list-table
    _, page, paths = _pages(tmp_path)
    assert render.main(["--results", str(results), *paths, "--no-chart"]) == 0
    assert "   * - GPU idle share\n     - 4.6%\n     - 1.2%\n" in page.read_text()
    # without profiled rows there is no such section
    (results / "2026-12-01-train.json").unlink()
    render.main(["--results", str(results), *paths, "--no-chart"])
    assert "ms per step)" not in page.read_text()


def test_each_row_is_also_compared_with_the_fastest_baseline_of_its_run(bench, results):
    render = bench("render_readme")
    rows = [_row("gpt2-medium-1gpu", "compile", "baseline", 60.0, 136000.0),
            _row("gpt2-medium-1gpu", "titan-style", "baseline", 68.0, 120000.0),
            _row("gpt2-medium-1gpu", "schedlang-optimize-cg", "schedlang", 48.0, 170000.0)]
    _write(results / "2026-12-02-train.json", rows, "2026-12-02", "3" * 40)
    lines = {line.split(" | ")[1]: line for line in render.render_table(render.load_results(results)).splitlines()
             if line.startswith("| gpt2-medium-1gpu |")}
    # named baseline: titan-style (170000 / 120000); fastest: whole-model compile (170000 / 136000)
    assert "| 1.42x titan-style | 1.25x compile |" in lines["schedlang-optimize-cg"]
    assert "| 1.00x titan-style | 0.88x compile |" in lines["titan-style"]


def test_merged_rows_keep_their_own_run_and_the_newest_run_of_a_day_wins(bench, results, tmp_path):
    render, harness = bench("render_readme"), bench("harness")
    one = tmp_path / "one.json"
    _write(one, [_row("llama-1.1b-tp2", "tp-titan", "baseline", 140.0, 58000.0, baseline="tp-titan")],
           "2026-12-03", "4" * 40, gpus=2, device="NVIDIA H200")
    target = results / "2026-12-03-train.json"
    _write(target, [_row("gpt2-medium-1gpu", "compile", "baseline", 60.0, 136000.0, baseline="compile")],
           "2026-12-03", "5" * 40)
    harness.merge_files(target, [one])
    data = json.loads(target.read_text())
    assert data["gpus"] == 2  # the header is the last source's...
    gpt2 = next(r for r in data["rows"] if r["work"] == "gpt2-medium-1gpu")
    assert (gpt2["device"], gpt2["gpus"], gpt2["git_sha"]) == ("NVIDIA H100 80GB HBM3", 1, "5" * 40)  # ...not the rows'
    table = render.render_table(render.load_results(results))
    line = next(x for x in table.splitlines() if x.startswith("| gpt2-medium-1gpu | compile |"))
    assert "| NVIDIA H100 80GB HBM3 x1 | 2026-12-03 | 5555555555 |" in line
    line = next(x for x in table.splitlines() if x.startswith("| llama-1.1b-tp2 | tp-titan |"))
    assert "| NVIDIA H200 x2 | 2026-12-03 | 4444444444 |" in line
    # a file of the same day written later (its header has the time) is newer, whatever its name
    later = results / "2026-12-03-a-probe.json"
    _write(later, [_row("gpt2-medium-1gpu", "compile", "baseline", 59.0, 138000.0, baseline="compile")],
           "2026-12-03", "6" * 40)
    data = json.loads(later.read_text())
    data["time"] = "23:59:00"
    later.write_text(json.dumps(data))
    table = render.render_table(render.load_results(results))
    line = next(x for x in table.splitlines() if x.startswith("| gpt2-medium-1gpu | compile |"))
    assert "| 59.0 |" in line and "6666666666" in line


def test_startup_rows_get_a_table_of_their_own_with_ratios_to_the_baseline(bench, tmp_path):
    render = bench("render_readme")
    d = tmp_path / "startup"
    d.mkdir()
    schedlang_row = dict(_row("llama-1.1b-from-safetensors", "schedlang-build-pretrained", "schedlang", 167.0, 49000.0),
                         time_to_first_step_s=2.319, load_s=1.295, peak_host_rss_gib=3.517, rounds=2,
                         first_run_time_to_first_step_s=4.358)
    baseline_row = dict(_row("llama-1.1b-from-safetensors", "from_pretrained+parallelize_module", "baseline", 333.0,
                             24000.0), time_to_first_step_s=3.126, load_s=1.888, peak_host_rss_gib=8.306, rounds=2)
    _write(d / "2026-11-28-pretrained.json", [schedlang_row, baseline_row], "2026-11-28", "f" * 40, gpus=2)
    table = render.render_startup(render.load_results(d))
    lines = table.splitlines()
    assert lines[0].startswith("| work | variant | role | time to first step s | vs baseline")
    mine = next(line for line in lines if "schedlang-build-pretrained" in line)
    assert "| 2.32 | 0.74x | 1.29 | 3.52 | 0.42x | 2 | 4.36 |" in mine
    assert "| 3.13 | 1.00x |" in next(line for line in lines if "parallelize_module" in line)
    assert "time to first step" in render.docs_section(render.load_results(d), tmp_path, tmp_path / "p.rst")
    # results without start-up rows render no such table
    assert render.render_startup([]) == ""


def test_a_work_whose_rows_differ_keeps_those_columns_in_its_table(bench, tmp_path):
    render = bench("render_readme")
    d = tmp_path / "r"
    d.mkdir()
    _write(d / "2026-12-06-train.json", [
        _row("llama-1.1b-2gpu", "fsdp2-titan", "baseline", 150.0, 100000.0, baseline=None),
        dict(_row("llama-1.1b-2gpu", "schedlang-fsdp", "schedlang", 140.0, 110000.0, baseline=None),
             optimizer="schedlang.optim.FusedAdamW"),
    ], "2026-12-06", "9" * 40, gpus=2)
    text = render.render_rows_by_work(render.load_results(d))
    # the optimizers differ: a column of their own; the run is shared: said once
    assert "**llama-1.1b-2gpu**: NVIDIA H100 80GB HBM3 x2, 2026-12-06, 9999999999\n" in text
    assert "     - optimizer\n" in text and "     - schedlang.optim.FusedAdamW\n" in text
    # no named baseline: each ratio is against the fastest baseline, named once in the header
    assert "     - vs baseline (best baseline)\n     - vs fastest baseline (fsdp2-titan)\n" in text
    assert "   * - schedlang-fsdp\n     - schedlang\n     - 140.0\n" in text

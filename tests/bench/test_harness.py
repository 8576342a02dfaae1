"""bench/harness.py: the correctness verdict of a variant, the rows' ratios, and the GPU clock samples."""

import json
import math
import time

import pytest
import torch


def test_check_losses_passes_and_fails(bench):
    h = bench("harness")
    anchor = {"variant": "titan-style", "losses": [10.4, 9.9, 9.5], "grad_norm": 2.0}
    ok = h.check_losses([10.41, 9.91, 9.52], 2.02, 10.4, anchor, h.TOL_BF16)
    assert ok["check"] == "ok" and ok["losses"] == [10.41, 9.91, 9.52]
    bad = h.check_losses([10.9, 9.9, 9.1], 2.5, 10.4, anchor, h.TOL_BF16)
    assert bad["check"] == ("FAIL first loss 10.9000 vs eager 10.4000; grad norm 2.5 vs titan-style 2; "
                            "loss of step 3 9.1000 vs titan-style 9.5000")
    # a step off the anchor's path fails even where the last step comes back onto it
    detour = h.check_losses([10.41, 9.6, 9.51], 2.02, 10.4, anchor, h.TOL_BF16)
    assert detour["check"] == "FAIL loss of step 2 9.6000 vs titan-style 9.9000"
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


def test_rounds_combine_into_the_median_of_their_medians(bench):
    h = bench("harness")

    def row(variant, ms, check="ok", mem=20.0):
        return h.make_row("w", variant, "baseline", ms, 1000, 1e12, 1, mem, check, ms_runs=[ms, ms + 1],
                          host_ms=ms - 1, losses=[round(ms)])

    rows = [row("a", 100.0), row("b", 90.0), row("a", 120.0, mem=21.0), row("b", 95.0, check="FAIL x"),
            row("a", 110.0), row("b", 80.0)]
    out = {r["variant"]: r for r in h.combine_rounds(rows)}
    a, b = out["a"], out["b"]
    assert list(out) == ["a", "b"]  # the first round's order
    assert a["ms"] == 110.0 and a["ms_rounds"] == [100.0, 120.0, 110.0] and a["rounds"] == 3
    assert a["ms_runs"] == [100.0, 101.0, 120.0, 121.0, 110.0, 111.0]
    assert a["tokens_per_s"] == round(1000 / 0.110, 1) and a["mfu"] == round(1e12 / 0.110 / h.PEAK_BF16_FLOPS, 4)
    assert a["peak_mem_gib"] == 21.0 and a["host_ms"] == 109.0 and a["check"] == "ok"
    assert a["losses"] == [100]  # other fields are the first round's
    assert b["ms"] == 90.0 and b["check"] == "FAIL x"  # a failure in any round is kept


def test_rounds_combine_the_gpu_clock_into_medians(bench):
    h = bench("harness")

    def row(ms, clock):
        return h.make_row("w", "a", "baseline", ms, 1000, 1e12, 1, 20.0, "ok", gpu_clock=clock)

    clocks = [{"sm_mhz": 1700, "power_w": 640.0, "power_capped": 1.0, "energy_j": 2000.0, "j_per_step": 80.0},
              {"sm_mhz": 1650, "power_w": 660.0, "power_capped": 0.9, "energy_j": None, "j_per_step": None},
              {"sm_mhz": 1600, "power_w": 650.0, "power_capped": 1.0, "energy_j": 2100.0, "j_per_step": 84.0}]
    rows = [row(100.0, clocks[0]), row(110.0, clocks[1]), row(105.0, clocks[2]), row(90.0, None)]
    clock = h.combine_rounds(rows)[0]["gpu_clock"]
    assert clock == {"sm_mhz": 1650, "power_w": 650.0, "power_capped": 1.0, "energy_j": 2050.0, "j_per_step": 82.0}


def test_a_variant_that_never_ran_stays_a_failed_row(bench):
    h = bench("harness")
    failed = h.failed_row("w", "c", "schedlang", "FAIL not available: no GPU")
    out = h.combine_rounds([failed, dict(failed)])
    assert len(out) == 1 and out[0]["ms"] is None and out[0]["check"] == "FAIL not available: no GPU"


def test_gpu_clock_sampler_summarizes_nvidia_smi_lines_and_skips_unreadable_ones(bench):
    sampler = bench("harness").GpuClockSampler(torch.device("cuda", 0))
    sampler.lines = ["1980, 301.5, Not Active", "1620, 695.0, Active", "[N/A], [N/A], Not Active", "1650, 69"]
    assert sampler.summary() == {"sm_mhz": 1800, "power_w": 498.2, "power_capped": 0.5, "samples": 2,
                                 "energy_j": None}
    sampler.energy_mj = [1_000_500, 1_250_000]  # the driver's counter at both ends of the block
    assert sampler.summary()["energy_j"] == pytest.approx(249.5)
    sampler.energy_mj = [1_000_500, None]  # the second read failed: no figure rather than a wrong one
    assert sampler.summary()["energy_j"] is None


def test_the_energy_counter_of_an_unknown_gpu_reads_as_missing(bench):
    # no NVML on this machine, or NVML without such a GPU: None, never an exception or a zero
    assert bench("harness").nvml_energy_mj("GPU-00000000-0000-0000-0000-000000000000") is None


def test_time_steps_gives_the_energy_per_step_from_the_counter(bench, monkeypatch):
    harness = bench("harness")

    class FakeSampler:
        def __init__(self, device):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def summary(self):
            return {"sm_mhz": 1700, "power_w": 650.0, "power_capped": 1.0, "samples": 9, "energy_j": 130.0}

    monkeypatch.setattr(harness, "GpuClockSampler", FakeSampler)
    timing = harness.time_steps(lambda: None, torch.device("cpu"), warmup=1, repeats=4, iters=5)
    assert timing["gpu_clock"]["j_per_step"] == 6.5  # 130 J over 4 repeats of 5 steps


def test_gpu_clock_sampler_samples_nothing_on_the_cpu(bench):
    with bench("harness").GpuClockSampler(torch.device("cpu")) as sampler:
        pass
    assert sampler.process is None and sampler.summary() is None
    timing = bench("harness").time_steps(lambda: None, torch.device("cpu"), warmup=1, repeats=2, iters=1)
    assert timing["gpu_clock"] is None and len(timing["ms_runs"]) == 2


@pytest.mark.gpu
def test_gpu_time_leaves_out_the_hosts_share(bench):
    harness = bench("harness")
    x = torch.ones(1024, device="cuda")

    def slow_host_tiny_kernel():
        time.sleep(0.002)  # the host takes 2 ms to issue a kernel the GPU runs in microseconds
        x.add_(1)

    assert harness.gpu_time_ms(slow_host_tiny_kernel, repeats=10) < 0.5
    big = torch.empty(2 ** 28, dtype=torch.int8, device="cuda")
    copy_ms = harness.gpu_time_ms(lambda: big.clone(), repeats=10)
    assert 0.01 < copy_ms < 50


@pytest.mark.gpu
def test_gpu_clock_sampler_reads_the_energy_counter(bench):
    harness = bench("harness")
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with harness.GpuClockSampler(torch.device("cuda", torch.cuda.current_device())) as sampler:
        t = time.perf_counter()
        while time.perf_counter() - t < 1.0:  # a second of GEMMs: a GPU draws well over 50 W doing them
            for _ in range(20):
                x @ x
            torch.cuda.synchronize()
    assert sampler.energy_j() is not None and 50 < sampler.energy_j() < 2000


def test_energy_sums_over_ranks_and_stays_missing_without_a_counter(bench):
    harness = bench("harness")
    # one process: the value itself (two ranks: test_energy_is_summed_over_two_gloo_ranks)
    assert harness.sum_over_ranks(12.5, torch.device("cpu")) == 12.5
    assert harness.sum_over_ranks(None, torch.device("cpu")) is None


def test_written_rows_carry_their_run_and_the_header_its_time(bench, tmp_path):
    harness = bench("harness")
    row = harness.make_row("w", "a", "baseline", 10.0, 1000, 1e12, 1, 1.0, "ok")
    path = harness.write_results("t", [row], gpus=0, directory=tmp_path)
    data = json.loads(path.read_text())
    assert len(data["time"]) == 8 and data["time"].count(":") == 2
    (written,) = data["rows"]
    for key in ("git_sha", "date", "time", "device", "gpus", "torch"):
        assert written[key] == data[key], key


def test_a_probe_is_written_without_rows_and_replaces_its_file_of_the_day(bench, tmp_path, capsys):
    harness = bench("harness")
    first = harness.write_probe("p", {"ms": [1.0]}, gpus=1, results_dir=str(tmp_path))
    second = harness.write_probe("p", {"ms": [2.0]}, gpus=1, results_dir=str(tmp_path))
    assert first == second and f"wrote {first}" in capsys.readouterr().out
    data = json.loads(second.read_text())
    assert data["rows"] == [] and data["probe"] == {"ms": [2.0]} and data["gpus"] == 1


def _sum_on_rank(rank, init_file, values, out_file):
    import sys

    import torch.distributed as dist

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "bench"))
    import harness

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        total = harness.sum_over_ranks(values[rank], torch.device("cpu"))
        missing = harness.sum_over_ranks(values[rank] if rank == 0 else None, torch.device("cpu"))
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump([total, missing], f)
    finally:
        dist.destroy_process_group()


def test_energy_is_summed_over_two_gloo_ranks(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "out.json"
    mp.spawn(_sum_on_rank, args=(str(tmp_path / "init"), [100.5, 98.0], str(out)), nprocs=2, join=True)
    # every GPU's energy counts; one rank without a counter makes the figure missing, not half of it
    assert json.loads(out.read_text()) == [198.5, None]


def test_the_gradient_check_wants_every_parameter_and_the_same_direction(bench):
    h = bench("harness")
    eager = {"embed.weight": [1.0, -2.0], "head.weight": [0.5, 3.0]}
    check = h.check_losses([10.0], 1.0, 10.0, None, h.TOL_BF16, dict(eager), eager)
    assert check["check"] == "ok" and check["grad_cosine"] == 1.0
    turned = {"embed.weight": [2.0, 1.0], "head.weight": [-3.0, 0.5]}  # orthogonal to eager's as a whole
    assert "first gradient's direction: cosine 0.0000" in h.check_losses([10.0], 1.0, 10.0, None, h.TOL_BF16, turned,
                                                                         eager)["check"]
    partial = h.check_losses([10.0], 1.0, 10.0, None, h.TOL_BF16, {"embed.weight": [1.0, -2.0]}, eager)["check"]
    assert partial == "FAIL gradients of 1 of 2 parameters missing (e.g. head.weight)"


def test_the_gradient_fingerprint_names_parameters_as_the_plain_model_does(bench):
    h = bench("harness")
    plain = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    wrapped = torch.nn.Module()
    wrapped._orig_mod = torch.nn.Module()
    wrapped._orig_mod.module = plain  # as torch.compile and DDP wrap a model
    plain(torch.randn(4, 5)).sum().backward()
    direct, through = h.grad_fingerprint(plain.named_parameters()), h.grad_fingerprint(wrapped.named_parameters())
    assert sorted(direct) == ["0.bias", "0.weight", "1.bias", "1.weight"] and through == direct
    # the same gradient gives the same numbers; another gradient other numbers
    assert h.grad_fingerprint(plain.named_parameters()) == direct
    plain[0].weight.grad.mul_(-1)
    assert h.grad_fingerprint(plain.named_parameters())["0.weight"] == [-v for v in direct["0.weight"]]

"""bench/bench_train.py --tiny: the benchmark's own code path on 2-layer models on the CPU (no timings checked)."""

import builtins
import json

import pytest
import torch


def _rows(path):
    data = json.loads(path.read_text())
    for key in ("git_sha", "date", "device", "gpus", "torch", "triton", "transformers"):
        assert key in data, key
    return data["rows"]


def _torchrun_bench_train(tmp_path, *args):
    """bench/bench_train.py --tiny under torchrun on 2 CPU ranks (gloo), its JSON written to ``tmp_path``.

    A rank that dies in native code (an abort, a segfault) leaves only torchrun's summary at the end of stderr, so
    the failure message also gives stdout's last rows (the variant that was running) and, through
    ``PYTHONFAULTHANDLER``, each rank's Python stack at the signal."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "bench_train.py"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), "--tiny",
         "--results-dir", str(tmp_path), "--repeats", "1", "--iters", "1", "--warmup", "2", *args],
        capture_output=True, text=True, timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1"))
    if result.returncode != 0:
        fatal = result.stderr.find("Fatal Python error")
        stack = result.stderr[fatal:fatal + 4000] if fatal >= 0 else ""
        pytest.fail(f"torchrun exited {result.returncode}\n--- stdout (end) ---\n{result.stdout[-1500:]}\n"
                    f"--- first rank's fatal error ---\n{stack}\n--- stderr (end) ---\n{result.stderr[-3000:]}")
    (path,) = tmp_path.glob("*-train-tiny.json")
    return path


def test_tiny_run_checks_every_variant_against_eager(bench, tmp_path):
    train = bench("bench_train")
    variants = ("eager", "titan-style", "schedlang-optimize")
    # a learning rate at which a wrong update moves a warm-up loss past the check's tolerance
    rows = train.main(["--tiny", "--work", "llama-1.1b-1gpu,gpt2-medium-1gpu", "--variants", ",".join(variants),
                       "--results-dir", str(tmp_path), "--repeats", "2", "--iters", "1", "--lr", "1e-2"])
    (path,) = tmp_path.glob("*-train-tiny.json")
    assert _rows(path) == rows
    assert {(r["work"], r["variant"]) for r in rows} == {
        (w, v) for w in ("llama-1.1b-1gpu", "gpt2-medium-1gpu") for v in variants}
    for r in rows:
        assert r["check"] == "ok", r
        assert r["role"] == ("schedlang" if r["variant"].startswith("schedlang") else "baseline")
        assert r["baseline"] == "titan-style" and r["optimizer"] == "torch.optim.AdamW(foreach=True)"  # its CPU twin
        assert r["use_cache"] is False and r["dtype"] == "fp32"
        assert len(r["ms_runs"]) == 2 and r["ms"] > 0 and r["host_ms"] > 0 and r["tokens_per_s"] > 0
        assert len(r["losses"]) == 3 and r["loss"]
    optimized = next(r for r in rows if r["variant"] == "schedlang-optimize")
    assert optimized["loss"] == "fused linear + cross entropy (labels=)"
    assert any(a.startswith("loss:") for a in optimized["optimize"]["applied"])


def test_schedlang_optimizer_on_both_sides(bench, tmp_path):
    train = bench("bench_train")
    rows = train.main(["--tiny", "--work", "llama-1.1b-1gpu", "--variants", "schedlang-layers",
                       "--optimizer", "schedlang-fused", "--results-dir", str(tmp_path), "--repeats", "1",
                       "--iters", "1", "--warmup", "1"])
    assert [r["variant"] for r in rows] == ["schedlang-layers+FusedAdamW"]
    for r in rows:
        assert r["check"] == "ok", r
        assert r["optimizer"] == "schedlang.optim.FusedAdamW" and r["baseline"] == "titan-style+FusedAdamW"


def test_float8_work_is_skipped_without_torchao(bench, tmp_path, monkeypatch, capsys):
    train = bench("bench_train")
    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name == "torchao" or name.startswith("torchao."):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    rows = train.main(["--tiny", "--work", "llama-1.1b-1gpu-fp8", "--results-dir", str(tmp_path)])
    assert "llama-1.1b-1gpu-fp8: skipped, torchao is not installed" in capsys.readouterr().out
    assert [r["check"] for r in rows] == ["FAIL skipped: torchao is not installed"] * len(
        train.WORKS["llama-1.1b-1gpu-fp8"].variants)
    assert all(r["ms"] is None for r in rows)


def test_a_two_gpu_work_in_one_process_says_how_to_run_it(bench, capsys):
    train = bench("bench_train")
    with pytest.raises(SystemExit):
        train.main(["--tiny", "--work", "llama-1.1b-tp2"])
    assert ("llama-1.1b-tp2 runs on 2 GPU(s) and this is 1 process(es): torchrun --nproc_per_node=2 "
            "bench/bench_train.py --work llama-1.1b-tp2") in capsys.readouterr().err


def test_unknown_variant_is_a_failed_row_naming_the_valid_ones(bench, tmp_path):
    train = bench("bench_train")
    (row,) = train.main(["--tiny", "--work", "llama-1.1b-1gpu", "--variants", "turbo", "--results-dir", str(tmp_path)])
    assert row["check"].startswith("FAIL ValueError: unknown variant 'turbo': valid are eager, compile, titan-style")


@pytest.mark.parametrize("optimizer", ["torch-fused", "schedlang-fused"])
def test_two_rank_works_on_gloo(tmp_path, optimizer):
    """The tensor-parallel and data-parallel variants under torchrun (2 CPU ranks, gloo), with torch's AdamW and
    with schedlang's FusedAdamW on every row. The learning rate is large enough that a wrong update of any
    shard moves a warm-up loss past the check's tolerance (at the default 1e-4 it hid one)."""
    variants = ("fsdp2-titan,fsdp2-titan-noreshard,tp-titan,schedlang-tp,schedlang-fsdp-optimize,ddp-titan,"
                "schedlang-fsdp-noreshard-optimize-bf16reduce")
    path = _torchrun_bench_train(tmp_path, "--work", "llama-1.1b-tp2,llama-1.1b-2gpu", "--variants", variants,
                                 "--lr", "1e-2", "--optimizer", optimizer)
    data = json.loads(path.read_text())
    rows = data["rows"]
    assert data["ranks"] == 2 and len(rows) == 14
    for r in rows:
        assert r["check"] == "ok" and r["lr"] == 1e-2, r
        assert r["optimizer"] == ("schedlang.optim.FusedAdamW" if optimizer == "schedlang-fused"
                                  else "torch.optim.AdamW(foreach=True)"), r
        for key in ("variant", "baseline"):
            r[key] = r[key].removesuffix("+FusedAdamW")
    layouts = {(r["work"], r["variant"]): r["layout"] for r in rows}
    assert layouts[("llama-1.1b-tp2", "schedlang-tp")] == "dp=1 x tp=2"
    assert layouts[("llama-1.1b-2gpu", "schedlang-fsdp-optimize")] == "dp=2 x tp=1"
    assert layouts[("llama-1.1b-2gpu", "ddp-titan")] == "dp=2 x tp=1"
    reshard = {r["variant"]: r.get("reshard_after_forward") for r in rows if r["work"] == "llama-1.1b-2gpu"}
    assert reshard["fsdp2-titan"] is True and reshard["fsdp2-titan-noreshard"] is False
    tp = next(r for r in rows if r["variant"] == "schedlang-tp" and r["work"] == "llama-1.1b-tp2")
    assert tp["batch"] == 2 and tp["baseline"] == "tp-titan"  # the group's batch, not per GPU


def test_selective_checkpointing_variants_recompute_every_nth_layer(bench, tmp_path):
    train = bench("bench_train")
    rows = train.main(["--tiny", "--work", "llama-1.1b-1gpu-ckpt", "--variants",
                       "schedlang-optimize,schedlang-optimize-ckpt2,schedlang-optimize-ckpt1",
                       "--results-dir", str(tmp_path), "--repeats", "1", "--iters", "1", "--warmup", "2"])
    assert [r["check"] for r in rows] == ["ok"] * 3, rows
    assert all(r["baseline"] == "schedlang-optimize" for r in rows)
    applied = {r["variant"]: [a for a in r["optimize"]["applied"] if a.startswith("checkpoint")] for r in rows}
    assert applied == {"schedlang-optimize": [], "schedlang-optimize-ckpt2": ["checkpoint: 1 of 2 layers"],
                       "schedlang-optimize-ckpt1": ["checkpoint: 2 of 2 layers"]}


def test_master_weights_variant_runs_only_with_schedlang_fused_adamw_on_every_row(bench, tmp_path):
    train = bench("bench_train")
    (row,) = train.main(["--tiny", "--work", "llama-1.1b-1gpu", "--variants", "schedlang-optimize-mw",
                         "--results-dir", str(tmp_path), "--repeats", "1", "--iters", "1", "--warmup", "1"])
    assert row["check"] == ("FAIL not available: master weights need schedlang's FusedAdamW on every row: run with "
                            "--optimizer schedlang-fused")
    rows = train.main(["--tiny", "--work", "llama-1.1b-1gpu", "--variants",
                       "schedlang-optimize,schedlang-optimize-mw,schedlang-optimize-fp8-mw-cg",
                       "--optimizer", "schedlang-fused", "--results-dir", str(tmp_path), "--repeats", "1",
                       "--iters", "1", "--warmup", "2"])
    assert rows[0]["check"] == "ok"  # the tiny run computes in fp32, where bf16 parameters have no place
    for row in rows[1:]:
        assert row["check"] == ("FAIL not available: master weights keep bf16 parameters for bf16 compute: a bf16 "
                                "run (on a GPU) needs them; this run computes in fp32")


def test_optimize_variant_names_compose_float8_master_weights_and_cuda_graphs(bench):
    train = bench("bench_train")
    assert len(set(train.OPTIMIZE_VARIANTS)) == 33
    assert {"schedlang-optimize", "schedlang-optimize-fp8-cg", "schedlang-optimize-mw-cg",
            "schedlang-optimize-fp8-mw-cg", "schedlang-optimize-mw-graph", "schedlang-optimize-mw-proj",
            "schedlang-optimize-mw-cdt", "schedlang-optimize-mw-proj-cdt",
            "schedlang-optimize-mw-knorm", "schedlang-optimize-mw-autotune",
            "schedlang-optimize-mw-overlap", "schedlang-optimize-fp8-mw-cg-pw-cdt",
            "schedlang-optimize-fp8-mw-cg-tma-nd", "schedlang-optimize-mw-mixtune",
            "schedlang-optimize-mw-tritonmm", "schedlang-optimize-fp8-mw-cg-nd",
            "schedlang-optimize-mw-graph-pdl-mixtune", "schedlang-optimize-mw-graph-pdl-mix64",
            "schedlang-optimize-fp8-mw-graph"} <= set(train.OPTIMIZE_VARIANTS)
    with pytest.raises(ValueError, match="unknown variant 'schedlang-optimize-cg-mw'"):
        train.make_variant(None, "schedlang-optimize-cg-mw", None)


def test_tuning_variants_pass_their_inductor_options_to_the_compiled_layers(bench, monkeypatch):
    import schedlang.models

    train = bench("bench_train")
    seen = []
    monkeypatch.setattr(schedlang.models, "optimize_model", lambda sch, **kw: seen.append(kw))

    class Ctx:
        args = type("Args", (), {"compile": True})()
        cuda = False

    class Sch:
        root = type("Root", (), {"metadata": {"optimize": {}}})()

    for tune in (("cdt",), ("autotune",), ("cdt", "pw"), ("tritonmm",), ()):
        train._optimize(Ctx(), Sch(), tune_kernels=tune)
    assert [kw["compile_options"] for kw in seen] == [
        {"options": {"coordinate_descent_tuning": True}},
        {"options": {"max_autotune": True, "triton.enable_persistent_tma_matmul": True}},
        {"options": {"coordinate_descent_tuning": True, "max_autotune_pointwise": True}},
        {"options": {"max_autotune": True, "max_autotune_gemm_backends": "TRITON",
                     "triton.enable_persistent_tma_matmul": True}}, None]
    # a variant's name picks its tunings: every suffix that names one, whatever the order
    picked = []
    monkeypatch.setattr(train, "make_schedlang_single", lambda ctx, cfg, **kw: picked.append(kw))
    train.make_variant(Ctx(), "schedlang-optimize-fp8-mw-cg-pw-cdt", None)
    train.make_variant(Ctx(), "schedlang-optimize-mw", None)
    assert picked[0]["tune_kernels"] == ("cdt", "pw") and picked[0]["float8"] == "tensorwise"
    assert picked[0]["master_weights"] and picked[0]["cudagraph_layers"]
    assert picked[1]["tune_kernels"] == () and picked[1]["float8"] is None


def test_every_tuning_names_an_option_inductor_has(bench):
    """torch.compile refuses an unknown option only when it compiles, which for these variants is on a GPU."""
    import torch._inductor.config as inductor_config

    train = bench("bench_train")
    for suffix, options in train.TUNING.items():
        for name in options:
            owner, _, leaf = name.rpartition(".")
            holder = getattr(inductor_config, owner) if owner else inductor_config
            assert hasattr(holder, leaf), f"-{suffix}: torch._inductor.config has no {name}"


def test_a_variant_whose_labels_are_not_shifted_fails_the_gradient_direction_check(bench, tmp_path, monkeypatch):
    """At a random initialization the loss is about ln(vocab) whatever the labels; only the gradient's direction
    shows that a variant trains on the wrong targets (here: each token as its own label)."""
    train = bench("bench_train")
    make_variant = train.make_variant

    def unshifted(ctx, name, cfg):
        setup = make_variant(ctx, "eager", cfg)
        model = setup.model

        def loss_fn(ids, labels):
            return train.B.plain_loss(model(input_ids=ids, use_cache=False).logits, ids)

        setup.loss_fn = loss_fn
        return setup

    monkeypatch.setattr(train, "make_variant", lambda ctx, name, cfg: (
        unshifted(ctx, name, cfg) if name == "titan-style" else make_variant(ctx, name, cfg)))
    rows = train.main(["--tiny", "--work", "llama-1.1b-1gpu", "--variants", "eager,titan-style",
                       "--results-dir", str(tmp_path), "--repeats", "1", "--iters", "1", "--warmup", "2"])
    good, bad = rows
    assert good["check"] == "ok" and good["grad_cosine"] > 0.9999
    assert "first gradient's direction: cosine" in bad["check"], bad["check"]
    assert bad["grad_cosine"] < 0.9
    # the loss alone would have passed: it is within the bf16 tolerance of the eager loss
    assert abs(bad["loss_first"] - bad["loss_eager"]) <= 1e-2 * bad["loss_eager"]


def test_a_whole_step_variant_steps_through_its_own_step_after_an_eager_first_one(bench, tmp_path, monkeypatch):
    """A variant whose Setup has ``step`` (a whole step replayed from a CUDA graph on a GPU) runs its first step
    eagerly, so that its gradients are checked, and every later one through ``step``; without a GPU,
    ``schedlang.CapturedStep`` runs the same step eagerly, which is what runs here."""
    import schedlang

    train = bench("bench_train")
    make_variant = train.make_variant
    through_step = []

    def with_whole_step(ctx, name, cfg):
        setup = make_variant(ctx, "schedlang-optimize", cfg)

        def loss_and_backward(ids, labels):
            loss = setup.loss_fn(ids, labels)
            loss.backward()
            return loss

        captured = schedlang.CapturedStep(loss_and_backward, setup.opt, warmup=2)

        def step(ids, labels):
            through_step.append(ids.shape)
            return captured(ids, labels)

        setup.step = step
        return setup

    monkeypatch.setattr(train, "make_variant", with_whole_step)
    (row,) = train.main(["--tiny", "--work", "llama-1.1b-1gpu", "--variants", "schedlang-optimize",
                         "--results-dir", str(tmp_path), "--repeats", "2", "--iters", "1", "--warmup", "3"])
    assert row["check"] == "ok", row
    assert len(through_step) == 2 + 2  # the warm-up steps after the first, then the timed ones
    assert len(row["losses"]) == 3 and row["losses"][0] > row["losses"][-1]  # it trains


def test_the_whole_step_variant_keeps_master_weights_and_so_needs_bf16_on_a_gpu(bench, tmp_path):
    train = bench("bench_train")
    (row,) = train.main(["--tiny", "--work", "llama-1.1b-1gpu", "--variants", "schedlang-optimize-mw-graph",
                         "--optimizer", "schedlang-fused", "--results-dir", str(tmp_path), "--repeats", "1",
                         "--iters", "1", "--warmup", "1"])
    assert row["check"].startswith("FAIL not available: master weights keep bf16 parameters"), row


def test_two_rank_float8_work_on_gloo(tmp_path):
    """FSDP2 with float8 all-gather, torchtitan's way and schedlang's, and DDP over torchao's float8 blocks (2 CPU
    ranks, float8 emulated; schedlang's DDP row keeps master weights, which need bf16 on a GPU)."""
    pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'schedlang[fp8]')")
    path = _torchrun_bench_train(tmp_path, "--work", "llama-1.1b-2gpu-fp8", "--variants",
                                 "fsdp2-titan-fp8,ddp-titan-fp8,schedlang-fsdp-fp8,schedlang-fsdp-fp8-optimize",
                                 "--optimizer", "schedlang-fused")
    rows = json.loads(path.read_text())["rows"]
    assert [r["variant"] for r in rows] == [v + "+FusedAdamW" for v in (
        "fsdp2-titan-fp8", "ddp-titan-fp8", "schedlang-fsdp-fp8", "schedlang-fsdp-fp8-optimize")]
    for r in rows:
        # schedlang's FusedAdamW on every row: under FSDP2 it updates torchao's float8 weight wrappers
        assert r["check"] == "ok" and r["layout"] == "dp=2 x tp=1", r
        assert r["baseline"] == "fsdp2-titan-fp8+FusedAdamW", r
        assert r["float8"] == ("tensorwise" if "ddp" in r["variant"] else "tensorwise, float8 all-gather"), r


def test_rounds_run_the_variants_in_turn_and_keep_every_round(bench, tmp_path):
    rows = bench("bench_train").main(["--tiny", "--work", "llama-1.1b-1gpu", "--variants", "eager,titan-style",
                                      "--rounds", "2", "--repeats", "1", "--iters", "1", "--warmup", "2",
                                      "--results-dir", str(tmp_path)])
    assert [r["variant"] for r in rows] == ["eager", "titan-style"]
    for r in rows:
        assert r["check"] == "ok" and r["rounds"] == 2 and len(r["ms_rounds"]) == 2, r
        assert sorted(r["ms_rounds"])[0] <= r["ms"] <= sorted(r["ms_rounds"])[-1]


def test_rounds_must_be_positive(bench):
    with pytest.raises(SystemExit):
        bench("bench_train").parse_args(["--rounds", "0"])


def test_a_captured_step_is_captured_within_the_warm_up(bench):
    train = bench("bench_train")

    class Ctx:
        cuda = False
        args = type("Args", (), {"warmup": 2})()

    setup = type("Setup", (), {"model": None, "opt": None, "notes": {}})()
    with pytest.raises(train.B.NotAvailable, match="a captured step needs --warmup of at least 3 .* got 2"):
        train._capture_whole_step(Ctx(), setup)
    Ctx.args.warmup = 3  # enough warm-up; without a GPU it says what it needs instead
    with pytest.raises(train.B.NotAvailable, match="needs a GPU"):
        train._capture_whole_step(Ctx(), setup)


def test_bf16reduce_variants_reduce_in_bf16_and_the_others_in_fp32(bench):
    """The ``-bf16reduce`` FSDP rows, native and schedlang's, differ from their fp32 twins only in the reduce dtype."""
    import types

    import torch

    B = bench("baselines")
    train = bench("bench_train")
    ctx = B.Context(types.SimpleNamespace(optimizer="torch-fused"), torch.device("cpu"), 2)
    ctx.bf16 = True  # as on a GPU: bf16 compute
    default, bf16 = ctx.mp_policy(), ctx.mp_policy(torch.bfloat16)
    assert (default.param_dtype, default.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    assert B.reduce_dtype_name(bf16) == "bfloat16" and B.reduce_dtype_name(default) == "float32"
    assert "fsdp2-titan-noreshard-bf16reduce" in B.BASELINES
    assert "schedlang-fsdp-noreshard-optimize-bf16reduce" in train.SCHEDLANG


def test_the_8b_four_gpu_work_is_the_whole_llama_3_8b(bench):
    """32 layers whatever --layers-8b says, and LLaMA-3-8B's 8.03 billion parameters (counted on the meta device)."""
    from transformers import LlamaForCausalLM

    train = bench("bench_train")
    work = train.WORKS["llama-8b-4gpu"]
    assert work.world == 4 and work.seq == 2048 and work.layers == 32
    assert work.baseline in work.variants and "fsdp2-titan" in work.variants and "tp-fsdp-titan" in work.variants
    cfg = bench("baselines").model_config(work.family, work.shape, tiny=False, layers=work.layers, seq=work.seq)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    assert cfg.num_hidden_layers == 32 and cfg.num_key_value_heads == 8
    assert 8.02e9 < n_params < 8.04e9, n_params


def test_the_trainers_default_row_on_two_ranks(tmp_path):
    """schedlang-train-default: the trainer's own flags, layout choice, build and step, on the work's model, batch
    and weights, passes the loss and gradient checks beside the baseline (2 CPU ranks, gloo)."""
    path = _torchrun_bench_train(tmp_path, "--work", "llama-1.1b-2gpu", "--variants",
                                 "fsdp2-titan,schedlang-train-default", "--lr", "1e-2")
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    row = rows["schedlang-train-default"]
    assert row["check"] == "ok" and row["role"] == "schedlang", row
    assert row["trainer"].startswith("schedlang.train --global-batch 4 --seq 32 (defaults) -> pp=1 ")
    assert row["trainer_flags"]["dtype"] == "fp32" and row["trainer_flags"]["optimizer"] == "adamw"  # CPU defaults
    assert row["layout_choice"].startswith("schedlang train: --layout auto chose ")

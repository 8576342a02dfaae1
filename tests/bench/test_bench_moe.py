"""bench/bench_moe.py: a tiny fp32 run on the CPU, at one rank and at two gloo ranks, gives every variant
the same first loss, gradient norm and expert gradient norm (transformers' expert loop, its grouped GEMM, schedlang's expert
parallelism with its FSDP2 units), and writes its rows."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _rows(directory: Path, gpus_name: str):
    (path,) = directory.glob(f"*-moe-{gpus_name}.json")
    data = json.loads(path.read_text())
    assert data["git_sha"] and data["torch"]
    return {r["variant"]: r for r in data["rows"]}


def _assert_variants_agree(rows):
    assert set(rows) == {"hf-loop-fsdp2", "hf-grouped-fsdp2", "schedlang-ep"}
    anchor = rows["hf-loop-fsdp2"]
    for variant, row in rows.items():
        assert row["check"] == "ok", (variant, row["check"])
        assert row["ms"] > 0 and row["tokens_per_s"] > 0
        # fp32 on the CPU: the variants differ only by the order of their sums
        assert row["first_loss"] == pytest.approx(anchor["first_loss"], rel=1e-5), variant
        assert row["first_grad_norm"] == pytest.approx(anchor["first_grad_norm"], rel=1e-4), variant
        assert row["first_expert_grad_norm"] == pytest.approx(anchor["first_expert_grad_norm"], rel=1e-4), variant


def test_one_rank(bench, tmp_path):
    moe = bench("bench_moe")
    rendezvous = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    assert moe.main(["--tiny", "--layers", "2", "--out", str(tmp_path)]) == 0
    _assert_variants_agree(_rows(tmp_path, "1gpu"))
    # one process needs no rendezvous, and leaves none for a later subprocess of the caller to inherit
    assert {k: os.environ.get(k) for k in rendezvous} == rendezvous


def _torchrun(script: Path, *args: str):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(29000 + os.getpid() % 500), str(script), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_two_ranks_spread_the_experts(tmp_path):
    done = _torchrun(ROOT / "bench" / "bench_moe.py", "--tiny", "--layers", "2", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_variants_agree(_rows(tmp_path, "2gpu"))


PLANTED = """
import sys
sys.path.insert(0, {bench!r})
import bench_moe
from schedlang.distributed.expert_parallel import ExpertParallelExperts

real = bench_moe._fsdp_units


def undivided(model, mesh, replica_mesh, world, policy):
    real(model, mesh, replica_mesh, world, policy)
    for module in model.modules():
        if isinstance(module, ExpertParallelExperts):
            module.set_gradient_divide_factor(1.0)


bench_moe._fsdp_units = undivided
sys.exit(bench_moe.main(sys.argv[1:]))
"""


def test_an_undivided_expert_gradient_fails_the_check(tmp_path):
    # an expert slice's gradient arrives summed over the expert-parallel group: left undivided by the world
    # (here at two ranks) it is twice the mean loss's, and the run reports the expert gradient norm's disagreement
    script = tmp_path / "planted.py"
    script.write_text(PLANTED.format(bench=str(ROOT / "bench")))
    done = _torchrun(script, "--tiny", "--layers", "2", "--variants", "hf-loop-fsdp2,schedlang-ep",
                     "--out", str(tmp_path))
    assert done.returncode == 1, done.stderr[-3000:]
    rows = _rows(tmp_path, "2gpu")
    assert rows["hf-loop-fsdp2"]["check"] == "ok"
    assert rows["schedlang-ep"]["check"].startswith("expert_grad_norm"), rows["schedlang-ep"]["check"]

"""The cluster flags: --nodes x --gpus-per-node (any size for a dry run; a launched run must match it), the two
link bandwidths and the deprecated --link-gbps, torchrun's topology, HSDP's --dp-replicate x --dp-shard, --dp
filled in from --tp / --pp, and the smoke-test sizes' warning."""

import json

import pytest

from schedlang import train as trainer
from schedlang.train.flags import build_parser, resolve_cluster

DRY = ["--dry-run", "--device", "cuda", "--gpu-memory-gib", "80"]


def _plan(capsys, *flags):
    assert trainer.main([*DRY, *flags]) == 0, capsys.readouterr().err
    return capsys.readouterr().err


def test_a_dry_run_plans_for_the_cluster_of_nodes_x_gpus(capsys):
    err = _plan(capsys, "--nodes", "8", "--gpus-per-node", "8", "--config", "1b", "--global-batch", "64",
                "--seq", "2048", "--intra-node-gbps", "400", "--inter-node-gbps", "25")
    assert "64 rank(s) on cuda" in err
    assert "8 node(s) x 8 GPU(s); intra-node 400.0 GB/s (given), inter-node 25.0 GB/s per GPU (given)" in err


def test_the_nominal_links_are_said_to_be_nominal(capsys):
    err = _plan(capsys, "--nproc", "16", "--config", "1b", "--global-batch", "32", "--seq", "2048")
    assert "2 node(s) x 8 GPU(s); intra-node 450.0 GB/s (nominal), inter-node 50.0 GB/s per GPU (nominal)" in err


def test_link_gbps_is_a_deprecated_alias_for_both_links(capsys, caplog):
    err = _plan(capsys, "--nproc", "16", "--config", "1b", "--global-batch", "32", "--seq", "2048",
                "--link-gbps", "100")
    assert "intra-node 100.0 GB/s (given), inter-node 100.0 GB/s per GPU (given)" in err
    assert "--link-gbps is deprecated" in caplog.text


@pytest.mark.parametrize("flags, message", [
    (["--nodes", "2", "--gpus-per-node", "2", "--nproc", "2"],
     "--nodes 2 x --gpus-per-node 2 = 4 ranks, but the run has 2 (--nproc 2); launch 4 ranks, or use --dry-run to "
     "plan for a cluster that is not here"),
    (["--nodes", "0"], "--nodes must be at least 1, got 0"),
    (["--inter-node-gbps", "-3"], "--inter-node-gbps must be a positive number, got -3.0"),
    (["--link-gbps", "10", "--intra-node-gbps", "20"], "--link-gbps sets both --intra-node-gbps and "
     "--inter-node-gbps, but --intra-node-gbps was given too; drop --link-gbps (deprecated)"),
    (["--json", "plan.json"], "--json writes the plan of --dry-run; add --dry-run"),
    (["--nproc", "4", "--dp-replicate", "2", "--dp-shard", "3"], "--dp-replicate 2 x --dp-shard 3 must multiply to "
     "the data-parallel ranks (4)"),
    (["--nproc", "4", "--dp-replicate", "1", "--dp-shard", "4"], "--dp-replicate 1: HSDP needs at least 2 replicas; "
     "with one, use --dp-mode fsdp --dp 4"),
    (["--nproc", "4", "--dp-replicate", "2", "--dp-mode", "ddp"], "--dp-replicate / --dp-shard describe HSDP, but "
     "--dp-mode is ddp; use --dp-mode hsdp"),
    (["--nproc", "2", "--dp", "2", "--dp-mode", "hsdp"], "--dp-mode hsdp needs --dp-replicate (replicas) and "
     "--dp-shard"),
])
def test_cluster_flags_fail_with_a_clear_message(flags, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert trainer.main(["--device", "cpu", "--config", "tiny", "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("schedlang train: error: ") and message in err, err


def test_a_dry_run_of_a_cluster_refuses_a_different_nproc(capsys):
    assert trainer.main([*DRY, "--nodes", "2", "--nproc", "8"]) == 2
    assert ("--nodes 2 x --gpus-per-node 8 = 16 ranks, but --nproc is 8; drop --nproc (a dry run plans for the "
            "cluster) or make them agree") in capsys.readouterr().err


def test_torchrun_gives_the_nodes(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    ns = build_parser().parse_args(["--device", "cpu"])
    assert resolve_cluster(ns, 16) == 16 and (ns.nodes, ns.gpus_per_node) == (4, 4)
    ns = build_parser().parse_args(["--device", "cpu", "--gpus-per-node", "8"])
    with pytest.raises(Exception, match=r"--gpus-per-node 8, but torchrun started 4 rank\(s\) per node"):
        resolve_cluster(ns, 16)


def test_local_ranks_are_one_node_and_a_dry_run_uses_nodes_of_eight(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    ns = build_parser().parse_args(["--device", "cpu", "--nproc", "4"])
    assert resolve_cluster(ns, 4) == 4 and (ns.nodes, ns.gpus_per_node) == (1, 4)
    ns = build_parser().parse_args(["--device", "cuda", "--nproc", "64", "--dry-run"])
    assert resolve_cluster(ns, 64) == 64 and (ns.nodes, ns.gpus_per_node) == (8, 8)


def test_tp_alone_fills_in_dp(capsys):
    """--tp 8 at 512 ranks is a layout: dp = 512 / 8."""
    err = _plan(capsys, "--nodes", "64", "--config", "8b", "--tp", "8", "--global-batch", "256", "--seq", "8192",
                "--activation-checkpoint")
    assert "layout      pp=1 dp=64 tp=8 (fsdp, activation checkpointing)" in err


def test_hsdp_flags_make_a_hybrid_layout(capsys):
    err = _plan(capsys, "--nodes", "4", "--config", "8b", "--dp-replicate", "4", "--dp-shard", "8",
                "--global-batch", "64", "--seq", "4096", "--activation-checkpoint", "selective")
    assert "layout      pp=1 dp=32 tp=1 (hsdp 4x8, selective activation checkpointing)" in err
    assert "all-gather over dp_shard: HSDP weights" in err and "intra-node" in err
    assert "all-reduce over dp_replicate: HSDP gradient shards, 32 x" in err and "inter-node" in err


def test_a_large_model_at_the_smoke_test_sizes_gets_a_warning(capsys, tmp_path):
    out = tmp_path / "plan.json"
    err = _plan(capsys, "--nproc", "64", "--config", "70b", "--json", str(out))
    assert ("warning     --global-batch and --seq left at the smoke-test default(s) (global batch 8, seq 64) for a "
            "70.6B-parameter model") in err
    assert json.loads(out.read_text())["warnings"][0].startswith("--global-batch and --seq left at")
    small = _plan(capsys, "--nproc", "2", "--config", "tiny")
    assert "smoke-test" not in small
    sized = _plan(capsys, "--nproc", "64", "--config", "70b", "--global-batch", "64", "--seq", "8192")
    assert "smoke-test" not in sized

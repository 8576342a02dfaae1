"""The trainer's expert parallelism beside data parallelism and pipeline stages, for the mixture-of-experts
families beyond Qwen3-MoE: Mixtral, OLMoE and DeepSeek-V3 (a shared expert, grouped routing, and a dense first
layer, so one pipeline stage holds no experts). Four ranks (``--dp 2 --pp 2 --ep 2``) train with one process's
losses and gradient norms, and the load metrics count every expert of every stage."""

from __future__ import annotations

import json

import pytest

from tests.helpers.trainer_runs import assert_same_steps, run_metrics

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FAMILIES = ["mixtral", "olmoe", "deepseek_v3"]


def _flags(family: str, config) -> list:
    return ["--model", family, "--config", str(config), "--steps", "3", "--global-batch", "4", "--seq", "16",
            "--lr", "3e-3", "--device", "cpu", "--dtype", "fp32", "--seed", "7"]


@pytest.mark.parametrize("family", FAMILIES)
def test_dp2_pp2_ep2_trains_like_one_process(tmp_path, family):
    from schedlang.models.family_configs import tiny_config

    config = tiny_config(family)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    common = _flags(family, path)
    reference = run_metrics(common, tmp_path / "single.jsonl")
    spread = run_metrics(common + ["--nproc", "4", "--dp", "2", "--pp", "2", "--ep", "2"], tmp_path / "spread.jsonl")
    assert [r["step"] for r in spread] == [1, 2, 3]
    assert_same_steps(spread, reference)
    # 4 rows of 15 tokens, each choosing 2 experts, in at most 2 blocks: every count is within [0, 4 x 15 x 2];
    # the experts do not all receive the same count
    for r in spread:
        assert 0 <= r["tokens_per_expert_min"] < r["tokens_per_expert_max"] <= 120

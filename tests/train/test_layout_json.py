"""``--dry-run --json FILE``: the plan as JSON, with integer degrees, the largest rank's peak, step time,
throughput, the collectives with their bytes and link, and the runners-up of --layout auto."""

import json

import pytest

from schedlang import train as trainer

DEGREES = ("pp", "dp_replicate", "dp_shard", "tp", "cp", "ep", "microbatches", "stages_per_rank")


def _plan(tmp_path, *flags):
    out = tmp_path / "plan.json"
    assert trainer.main(["--dry-run", "--device", "cuda", "--gpu-memory-gib", "80", "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())


def test_the_json_plan_of_layout_auto(tmp_path, capsys):
    data = _plan(tmp_path, "--nodes", "8", "--config", "70b", "--global-batch", "64", "--seq", "8192")
    layout = data["layout"]
    for key in DEGREES:
        assert isinstance(layout[key], int) and layout[key] >= 1, key
    assert layout["cp"] == layout["ep"] == 1
    assert layout["pp"] * layout["dp_replicate"] * layout["dp_shard"] * layout["tp"] == data["world"] == 64
    assert layout["activation_checkpoint"] in ("none", "selective", "full")
    rows = data["global_batch"] // (layout["dp_replicate"] * layout["dp_shard"])
    assert layout["local_batch"] * layout["microbatches"] == rows
    for key in ("peak_gib", "step_ms", "tokens_per_s"):
        assert isinstance(data[key], float) and data[key] > 0, key
    assert data["peak_gib"] <= data["usable_gib"] and data["fits"] is True
    assert data["tokens_per_s"] * data["step_ms"] / 1e3 == pytest.approx(64 * 8192)
    assert data["collectives"] and all(c["link"] in ("intra-node", "inter-node") and c["bytes_each"] > 0
                                       and isinstance(c["count"], int) for c in data["collectives"])
    assert data["cluster"] == {"nodes": 8, "gpus_per_node": 8, "device": "GPU", "memory_gib": 80.0,
                               "intra_node_gbps": 450.0, "inter_node_gbps": 50.0, "intra_node_source": "nominal",
                               "inter_node_source": "nominal"}
    assert len(data["runners_up"]) >= 3
    for r in data["runners_up"]:
        assert r["why"].startswith(("slower by", "does not fit")) and set(DEGREES) <= set(r["layout"])
    assert data["chosen_by"] == "auto" and data["why"]
    # the text and the file say the same
    err = capsys.readouterr().err
    assert f"--layout auto chose {layout['describe']}" in err


def test_the_json_plan_of_a_given_layout(tmp_path):
    data = _plan(tmp_path, "--nodes", "4", "--config", "8b", "--dp-replicate", "4", "--dp-shard", "8",
                 "--global-batch", "64", "--seq", "4096", "--activation-checkpoint")
    assert {k: data["layout"][k] for k in DEGREES} == {"pp": 1, "dp_replicate": 4, "dp_shard": 8, "tp": 1, "cp": 1,
                                                       "ep": 1, "microbatches": 1, "stages_per_rank": 1}
    assert data["layout"]["activation_checkpoint"] == "full" and data["layout"]["dp_mode"] == "hsdp"
    assert data["chosen_by"] == "flags" and data["runners_up"] == []
    links = {(c["group"], c["op"]): c["link"] for c in data["collectives"]}
    assert links == {("dp_shard", "all-gather"): "intra-node", ("dp_shard", "reduce-scatter"): "intra-node",
                     ("dp_replicate", "all-reduce"): "inter-node"}


def test_a_mixture_of_experts_dry_run_with_ep_shows_the_experts_and_the_imbalance(tmp_path, capsys):
    from transformers import AutoConfig

    config = tmp_path / "moe"
    AutoConfig.for_model("qwen3_moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         num_experts=16, num_experts_per_tok=4, vocab_size=1000).save_pretrained(config)
    data = _plan(tmp_path, "--nproc", "8", "--dp", "8", "--ep", "4", "--config", str(config), "--global-batch", "8",
                 "--seq", "512")
    assert data["layout"]["ep"] == 4 and data["moe"]["experts_per_rank"] == 4 and data["moe"]["top_k"] == 4
    assert data["moe"]["load_imbalance"] > 1
    a2a = [c for c in data["collectives"] if c["op"] == "all-to-all"]
    assert len(a2a) == 1 and a2a[0]["group"] == "ep" and a2a[0]["link"] == "intra-node"
    err = capsys.readouterr().err
    assert "ep=4: 4 expert(s) per rank" in err and "the mean tokens" in err

"""``cut_pipeline_stage``: call-time checks, the plan record and JSON replay.

Splitting and running the stages is tested in tests/distributed/test_pipeline.py.
"""

import pytest

import schedlang
from schedlang.primitives.cut_pipeline_stage import cut_paths

transformers = pytest.importorskip("transformers")


def _llama():
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=4, intermediate_size=64, vocab_size=64,
                                      max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def test_cut_records_a_step_and_changes_no_module():
    model = _llama()
    sch = schedlang.create_schedule(model)
    before = {n: type(m) for n, m in sch.mod.named_modules()}
    layer = sch["model.layers.1"].mod
    assert sch["model.layers.1"].cut_pipeline_stage() is None
    sch["model.layers.3"].cut_pipeline_stage()
    assert {n: type(m) for n, m in sch.mod.named_modules()} == before
    assert sch["model.layers.1"].mod is layer and "forward" not in layer.__dict__
    assert cut_paths(sch.plan) == ["model.layers.1", "model.layers.3"]
    assert "cut_pipeline_stage  model.layers.3" in str(sch.plan)
    assert "cut_pipeline_stage" in schedlang.list_primitives()


def test_cut_replays_from_json():
    sch = schedlang.create_schedule(_llama())
    sch["model.layers.2"].cut_pipeline_stage()
    text = sch.plan.to_json()
    replayed = schedlang.replay(text, _llama())
    assert cut_paths(replayed.plan) == ["model.layers.2"]
    assert replayed.plan.to_json() == text


@pytest.mark.parametrize("setup,path,message", [
    ([], "", r"^<root>: cannot cut a pipeline stage after the whole model \(nothing would run after it\); cut after "
             r"a submodule"),
    (["model.layers.1"], "model.layers.1",
     r"^model\.layers\.1: a pipeline stage already ends after this module; each module can be cut once \(cuts so "
     r"far: model\.layers\.1\)"),
    (["model.layers.1"], "model.layers.1.mlp",
     r"^model\.layers\.1\.mlp: lies inside 'model\.layers\.1', after which a pipeline stage already ends"),
    (["model.layers.1.mlp"], "model.layers.1",
     r"^model\.layers\.1: contains 'model\.layers\.1\.mlp', after which a pipeline stage already ends"),
])
def test_cut_errors(setup, path, message):
    sch = schedlang.create_schedule(_llama())
    for p in setup:
        sch[p].cut_pipeline_stage()
    steps = len(sch.plan)
    with pytest.raises(schedlang.ScheduleValueError, match=message):
        sch[path].cut_pipeline_stage()
    assert len(sch.plan) == steps


def test_cut_inside_a_checkpointed_module_is_refused():
    sch = schedlang.create_schedule(_llama())
    sch["model.layers.1"].checkpoint()
    sch["model.layers.1"].cut_pipeline_stage()  # the checkpointed module itself runs as one call: fine
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"^model\.layers\.2\.mlp: cannot end a pipeline stage here because its enclosing module "
                             r"'model\.layers\.2' is activation-checkpointed .*; cut after 'model\.layers\.2' itself"):
        sch["model.layers.2"].checkpoint()
        sch["model.layers.2.mlp"].cut_pipeline_stage()


def test_build_without_pipeline_options_says_how_to_run_the_stages():
    sch = schedlang.create_schedule(_llama())
    sch["model.layers.1"].cut_pipeline_stage()
    with pytest.raises(schedlang.SchedlangError, match=r"model\.layers\.1.*pipeline="):
        schedlang.build(sch)

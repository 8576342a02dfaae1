"""The sweep of ``shard_model`` over every causal-LM family transformers ships, and its table in the docs.

``docs/families.rst`` is written by ``python -m schedlang.models.family_sweep --write docs/families.rst``:
every family at TP=2 inside Verify (tens of minutes). Here, in minutes:

* the structural pass (``shard_model`` on each family's tiny model on the meta device, no forward) runs
  for every family, in this process as rank 0 of 2, and must say what the table says: the same decision,
  the same refusal or skip, the same description of what is split;
* the full verification runs on a representative subset (dense, ALiBi, mixture of experts, parallel
  attention and MLP, a refused family, a skipped one) and must give the table's result.
"""

import contextlib
import importlib
import os
import pkgutil
import warnings
from pathlib import Path
from unittest import mock

import pytest

import schedlang
from schedlang.models import family_sweep as S
from schedlang.models.family_configs import FamilySkipped, _kept_layers, causal_lm_families, tiny_config

TABLE = Path(__file__).resolve().parents[2] / "docs" / "families.rst"
#: dense (LLaMA), attention sinks split and experts kept whole (gpt-oss), refused by the fake run of the split
#: model (DiffLlama), skipped (BART); tests/models/test_tp_patterns.py verifies one family of each other pattern
REPRESENTATIVE = ["llama", "gpt_oss", "diffllama", "bart"]
REGENERATE = "regenerate it: python -m schedlang.models.family_sweep --write docs/families.rst"


def _table():
    table = S.read_table(TABLE)
    import transformers

    if table["transformers"] != transformers.__version__:
        message = (f"docs/families.rst was swept with transformers {table['transformers']}, this is "
                   f"{transformers.__version__}; {REGENERATE}")
        if os.environ.get("SCHEDLANG_REQUIRE_PINNED"):
            pytest.fail(message)
        pytest.skip(message)
    return table["rows"]


def test_the_table_lists_every_family_of_the_installed_transformers():
    rows = _table()
    assert sorted(rows) == sorted(f.model_type for f in causal_lm_families()), REGENERATE
    assert {r.result for r in rows.values()} <= set(S.RESULTS)
    assert not [name for name, r in rows.items() if r.result == "fails"], "families whose plan Verify rejects"


@contextlib.contextmanager
def _two_ranks():
    """This process as rank 0 of 2 for the schedule (no process group: the structural pass runs no collective)."""
    import schedlang.distributed
    import schedlang.distributed.groups as groups
    import schedlang.op
    import schedlang.sharding

    # modules bind groups.world_size when first imported: one imported under the patch would keep two ranks
    for package in (schedlang.distributed, schedlang.op, schedlang.sharding):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            importlib.import_module(info.name)
    with mock.patch.object(groups, "world_size", lambda group=None: S.WORLD), \
            mock.patch.object(groups, "rank", lambda group=None: 0):
        yield


def test_the_structural_pass_decides_what_the_table_says():
    rows = _table()
    by_type = {f.model_type: f for f in causal_lm_families()}
    with _two_ranks(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the families' own warnings (defaults, untied weights)
        decided = [S.decide(by_type[name]) for name in sorted(by_type)]
    problems = S.differences(rows, decided)
    assert not problems, "\n".join(problems + [REGENERATE])


def test_representative_families_verified_at_world_2_give_the_tables_result():
    rows = _table()
    for r in S.run_sweep(REPRESENTATIVE, verify=True, chunk=len(REPRESENTATIVE), timeout=900):
        row = rows[r.model_type]
        assert (r.result, r.reason) == (row.result, row.reason), (r, row)


# ------------------------------------------------------------------------------------------ one process

def test_tiny_configs_are_small_and_keep_a_layer_of_each_kind():
    config = tiny_config("llama")
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers,
            config.vocab_size) == (64, 4, 2, 2, 128)
    gpt2 = tiny_config("gpt2")  # its own names: n_embd, n_head, n_layer
    assert (gpt2.n_embd, gpt2.n_head, gpt2.n_layer, gpt2.resid_pdrop) == (64, 4, 2, 0.0)
    # one layer of each kind, in order (a hybrid keeps its attention and its other layers)
    assert _kept_layers({"layer_types": ["a", "a", "a", "b", "a", "b"]}, 6) == [0, 3]
    assert _kept_layers({"layer_types": ["a"] * 5}, 5) == [0, 1]


@pytest.mark.parametrize("model_type,why", [
    ("bart", "encoder-decoder: its causal LM is the decoder half, with cross-attention"),
    ("gemma3", "multimodal: an image or audio encoder beside the decoder, not a decoder-only model"),
])
def test_families_that_cannot_be_checked_from_a_small_config_say_why(model_type, why):
    with pytest.raises(FamilySkipped, match=f"^{why}$"):
        tiny_config(model_type)


def test_the_table_reads_back_what_was_written(tmp_path):
    results = [S.FamilyResult("llama", "LlamaForCausalLM", "passes", "self_attn (attention: q|k|v -> o); *x*"),
               S.FamilyResult("bart", "BartForCausalLM", "skipped", "encoder-decoder: `x` | y"),
               S.FamilyResult("olmo2", "Olmo2ForCausalLM", "refused", "")]
    S.write_table(tmp_path / "t.rst", results, date="2026-11-28")
    table = S.read_table(tmp_path / "t.rst")
    assert table["rows"]["llama"] == results[0]
    assert table["rows"]["bart"] == results[1]  # markup characters escaped, read back as written
    assert table["rows"]["olmo2"].reason == ""
    assert "1 passes, 1 refused, 1 skipped of 3" in (tmp_path / "t.rst").read_text()


def test_differences_name_each_family_whose_decision_or_reason_changed():
    table = {"a": S.FamilyResult("a", "A", "passes", "split"), "b": S.FamilyResult("b", "B", "refused", "why"),
             "c": S.FamilyResult("c", "C", "fails", "Verify: mismatch"), "d": S.FamilyResult("d", "D", "skipped", "x")}
    now = [S.FamilyResult("a", "A", "accepted", "split"), S.FamilyResult("b", "B", "refused", "another reason"),
           S.FamilyResult("c", "C", "accepted", "split"), S.FamilyResult("e", "E", "skipped", "new")]
    assert S.differences(table, now) == [
        "b: the table says refused (why); now refused (another reason)",
        "d: no longer in transformers",
        "e: not in the table",
    ]


def test_an_unknown_family_is_refused_naming_valid_ones():
    with pytest.raises(schedlang.SchedlangError, match=r"^family_sweep: unknown model type\(s\) nosuch; valid are the "
                                                       r"keys of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, e\.g\. "
                                                       r"llama, gpt2, mixtral$"):
        S.run_sweep(["nosuch"])


def test_the_expert_parallel_column_reads_back_and_its_structural_part_is_checked(tmp_path):
    results = [S.FamilyResult("qwen3_moe", "Qwen3MoeForCausalLM", "passes", "split", expert_parallel="passes (ep=2)"),
               S.FamilyResult("llama", "LlamaForCausalLM", "passes", "split"),
               S.FamilyResult("x", "X", "refused", "why", expert_parallel="refused: UnsupportedModelError: a list")]
    S.write_table(tmp_path / "t.rst", results, date="2026-11-28", expert_parallel_date="2026-12-06")
    table = S.read_table(tmp_path / "t.rst")
    assert table["rows"] == {r.model_type: r for r in results} and table["date"] == "2026-11-28"
    assert "the expert-parallel column on 2026-12-06; expert parallelism passes on 1" in (tmp_path / "t.rst").read_text()
    # the structural pass says only whether it applies: a verified "passes" agrees with "applies", a refusal
    # must be the same refusal, a family that gained or lost its experts is named
    now = [S.FamilyResult("qwen3_moe", "Qwen3MoeForCausalLM", "accepted", "split", expert_parallel="applies"),
           S.FamilyResult("llama", "LlamaForCausalLM", "accepted", "split", expert_parallel="applies"),
           S.FamilyResult("x", "X", "refused", "why", expert_parallel="refused: UnsupportedModelError: other")]
    assert S.differences(table["rows"], now) == [
        "llama: the table's expert-parallel column says —; now applies",
        "x: the table's expert-parallel column says refused: UnsupportedModelError: a list; now refused: "
        "UnsupportedModelError: other",
    ]

"""``shard_model`` on thirteen HF families at world 2 (gloo) and world 1: Verify passes, loss and gradients match.

Every family runs in one launch of two ranks (start-up dominates on a small CI machine). For each,
``shard_model(sch, gather_logits=True)`` runs inside ``schedlang.Verify`` (forward and every gradient
against the unsharded model), and a second schedule with the default split logits and the
vocabulary-parallel loss is built and compared with the single-device model on labels with ignored
tokens. The hand-written OPT schedule that once built a wrong model (q/k/v column-parallel,
out_proj/fc2 row-parallel, ``num_heads`` left global) is checked here too.
"""

import copy

import pytest
import torch

import schedlang
from schedlang.models import plan_tensor_parallel, shard_model
from schedlang.module_record import shard_specs
from tests.helpers.distributed import run_distributed
from tests.models import tp_checks as T

SEQ = 11
AUTOMATIC = ["opt", "gpt_neox", "gemma", "phi3", "qwen3", "stablelm", "falcon", "gptj", "mistral", "qwen2"]
#: families with an override of the automatic plan (their own tests compare split logits and the loss)
OVERRIDES = ["llama", "gpt2", "bert"]


def _inputs():
    ids = torch.randint(2, T.VOCAB, (2, SEQ), device=T.device())
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _family(family: str):
    def run():
        model, _ = T.family_model(family)
        model = model.to(T.device())
        ids, labels = _inputs()
        sch = schedlang.create_schedule(model)
        with schedlang.Verify(sch, example_inputs=[ids]):
            plan = shard_model(sch, gather_logits=True)
        out = {"plan": str(plan), "schedule": plan.schedule, "steps": plan.steps}
        if family in OVERRIDES:  # their own tests compare split logits and the vocabulary-parallel loss
            return out
        sch = schedlang.create_schedule(model)
        shard_model(sch)
        built, _ = schedlang.build(sch)
        result = T.compare(built, copy.deepcopy(model), {"input_ids": ids, "labels": labels}, logits_split=True)
        result["n_params"] = len(list(model.named_parameters(remove_duplicate=False)))
        out.update(result)
        return out

    return run


def _hand_written_opt():
    """The OPT schedule a user writes by hand, step by step, checked by Verify."""
    model, cfg = T.family_model("opt")
    ids, _ = _inputs()
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]):
        for i in range(cfg.num_hidden_layers):
            layer = sch[f"model.decoder.layers.{i}"]
            attn = layer["self_attn"]
            for n in ("q_proj", "k_proj", "v_proj"):
                attn[n].shard("weight", axis=0)
                attn[n].shard("bias", axis=0)
            attn["out_proj"].shard("weight", axis=1)
            attn["out_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
            attn.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
            layer["fc1"].shard("weight", axis=0)
            layer["fc1"].shard("bias", axis=0)
            layer["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
            layer["fc2"].shard("weight", axis=1)
            layer["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    attn = sch["model.decoder.layers.0.self_attn"].mod
    return {"num_heads": attn.num_heads, "user_heads": model.model.decoder.layers[0].self_attn.num_heads}


def _phi3_grouped_query_attention():
    """Phi-3 with 4 query and 2 key/value heads: its fused qkv_proj holds q | k | v of unequal widths."""
    from schedlang.distributed.sharding import shard_specs

    model, _ = T.family_model("phi3_gqa")
    model = model.to(T.device())
    ids, _ = _inputs()
    sch = schedlang.create_schedule(model, mesh=T.tp_mesh())  # DTensor parameters: the placement is checked
    with schedlang.Verify(sch, example_inputs=[ids]):  # outputs and every gradient against the unsharded model
        plan = shard_model(sch, gather_logits=True)
    attn = sch["model.layers.0.self_attn"].mod
    out = {"spec": shard_specs(attn.qkv_proj)["weight"], "local_rows": attn.qkv_proj.weight.shape[0],
           "heads": (attn.config.num_attention_heads, attn.num_key_value_heads, attn.num_key_value_groups),
           "user_heads": model.model.layers[0].self_attn.num_key_value_heads, "schedule": plan.schedule}
    built, _ = schedlang.build(sch)  # the q|k|v weight: a DTensor of its rank-major rows (test_tp_unequal_blocks.py)
    out["build"] = str(built.model.layers[0].self_attn.qkv_proj.weight.placements)
    return out


def _world2(rank, world):
    scenarios = {f: _family(f) for f in AUTOMATIC + OVERRIDES}
    scenarios["hand_written_opt"] = _hand_written_opt
    scenarios["phi3_gqa"] = _phi3_grouped_query_attention
    return T.run_scenarios(scenarios)


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2, world_size=2, timeout=400)


@pytest.mark.parametrize("family", AUTOMATIC + OVERRIDES)
def test_shard_model_passes_verify_and_matches_single_device_at_world_2(world2, family):
    for r in T.value(world2, family):
        assert r["steps"] > 0
        # the overrides are the automatic plan with the family's options: the same description
        assert r["schedule"] == ("automatic" if family in AUTOMATIC else f"shard_{family}")
        assert "vocabulary-parallel LM head" in r["plan"] and "row-parallel" in r["plan"], r["plan"]
        if family in OVERRIDES:
            continue
        T.assert_matches(r)
        assert r["local_vocab"] == T.VOCAB // 2
        assert r["grads_compared"] == r["n_params"]


def test_phi3_fused_qkv_with_fewer_key_value_heads_is_split_in_unequal_blocks(world2):
    for rank, r in enumerate(T.value(world2, "phi3_gqa")):
        spec = r["spec"]
        assert (spec.blocks, spec.groups, spec.full_shape, spec.rank) == ((64, 32, 32), 3, (128, T.HIDDEN), rank)
        assert r["local_rows"] == 64  # 2 query heads + 1 key head + 1 value head, of 16
        assert r["heads"] == (2, 1, 2) and r["user_heads"] == 2 and r["schedule"] == "automatic"
        assert r["build"] == "(Shard(dim=0),)", r["build"]


def test_phi3_fused_qkv_with_fewer_key_value_heads_than_ranks_is_refused():
    import importlib
    import pkgutil
    from unittest import mock

    import schedlang.distributed
    import schedlang.distributed.groups as groups

    # modules bind groups.world_size when first imported: imported under the patch below, they would keep its
    # four ranks for the rest of the session (later one-process tests then saw a world of 4)
    for info in pkgutil.walk_packages(schedlang.distributed.__path__, "schedlang.distributed."):
        importlib.import_module(info.name)
    model, _ = T.family_model("phi3_gqa", layers=1)  # 2 key/value heads
    sch = schedlang.create_schedule(model)
    with mock.patch.object(groups, "world_size", lambda group=None: 4), \
            mock.patch.object(groups, "rank", lambda group=None: 0):
        with pytest.raises(schedlang.ShardError,
                           match=r"^model.layers.0.self_attn.qkv_proj: cannot shard 'weight': the fused q\|k\|v "
                                 r"projection has 2 key/value heads, fewer than the 4 ranks; key/value heads are not "
                                 r"replicated: use at most 2 ranks or a model with more key/value heads; "
                                 r"Phi3Attention.forward reads "):
            shard_model(sch)
    assert len(sch.plan) == 0 and not shard_specs(sch["model.layers.0.self_attn.qkv_proj"].mod)


def test_hand_written_opt_schedule_gets_local_head_counts(world2):
    for r in T.value(world2, "hand_written_opt"):
        assert r == {"num_heads": 2, "user_heads": 4}


@pytest.mark.parametrize("family", AUTOMATIC)
def test_automatic_plans_leave_the_model_unchanged_at_world_1(family):
    r = _family(family)()  # one process, no process group: a world of one
    T.assert_matches(r, tol=1e-6)
    assert r["local_vocab"] == T.VOCAB and r["grads_compared"] == r["n_params"]


def test_register_family_and_automatic_plan_errors():
    from schedlang.models import FAMILIES, register_family

    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"^register_family: the prefix must be a non-empty class-name prefix, got ''$"):
        register_family("", lambda sch: sch)
    with pytest.raises(schedlang.ScheduleTypeError,
                       match=r"^register_family: 3 for 'OPT' is not callable; pass fn\(sch, \*\*options\)$"):
        register_family("OPT", 3)
    model, _ = T.family_model("opt", layers=1)
    calls = []
    register_family("OPTFor", lambda sch, **options: calls.append(options))
    try:
        plan = shard_model(schedlang.create_schedule(model), gather_logits=True)
    finally:
        FAMILIES.pop("OPTFor")
    assert calls == [{"gather_logits": True}] and plan.schedule == "<lambda>" and plan.steps == 0


def test_automatic_plan_is_all_or_nothing_and_names_what_it_cannot_split():
    from unittest import mock

    import schedlang.distributed.groups as groups

    model, _ = T.family_model("gemma", layers=2)  # 2 key/value heads
    sch = schedlang.create_schedule(model)
    with mock.patch.object(groups, "world_size", lambda group=None: 4), \
            mock.patch.object(groups, "rank", lambda group=None: 0):
        with pytest.raises(schedlang.ShardError,
                           match=r"^model.layers.0.self_attn.k_proj: cannot shard 'weight': the key/value projection "
                                 r"has 2 heads, fewer than the 4 ranks"):
            shard_model(sch)
    assert len(sch.plan) == 0
    assert not shard_specs(sch["model.layers.0.self_attn.q_proj"].mod)


@pytest.mark.parametrize("family, call, error, message", [
    ("llama", lambda sch: shard_model(sch, foo=1), schedlang.ScheduleValueError,
     r"^shard_model: unknown option 'foo'; valid options for LlamaForCausalLM \(schedule shard_llama\) are "
     r"sequence_parallel, gather_logits, shard_embeddings, grad_sync, float8$"),
    ("opt", lambda sch: shard_model(sch, foo=1, gather_logit=True), schedlang.ScheduleValueError,
     r"^shard_model: unknown options 'foo', 'gather_logit'; valid options for OPTForCausalLM \(schedule shard_auto\) "
     r"are sequence_parallel, gather_logits, float8$"),
    ("llama", lambda sch: shard_model(sch, sequence_parallel="yes"), schedlang.ScheduleValueError,
     r"^shard_model: sequence_parallel must be True or False, got str 'yes'$"),
    ("llama", lambda sch: shard_model(sch, float8={"bogus": 1}), schedlang.ScheduleValueError,
     r"^shard_model: float8 has unknown Schedule\.float8 argument 'bogus'; valid keys are recipe, skip, filter, "
     r"min_features, fsdp_float8_all_gather, emulate$"),
    ("opt", lambda sch: plan_tensor_parallel(sch, foo=1), schedlang.ScheduleValueError,
     r"^plan_tensor_parallel: unknown option 'foo'; valid options are gather_logits, sequence_parallel$"),
    ("opt", lambda sch: plan_tensor_parallel(sch, sequence_parallel="yes"), schedlang.ScheduleValueError,
     r"^plan_tensor_parallel: sequence_parallel must be True or False, got str 'yes'$"),
])
def test_unknown_and_non_flag_options_are_refused_before_any_step(family, call, error, message):
    """Python's own TypeError ('got an unexpected keyword argument') named neither the valid options nor where
    they go, and ``bool("yes")`` quietly turned sequence parallelism on."""
    model, _ = T.family_model(family, layers=1)
    sch = schedlang.create_schedule(model)
    with pytest.raises(error, match=message) as info:
        call(sch)
    assert isinstance(info.value, ValueError)
    assert len(sch.plan) == 0


def test_plan_tensor_parallel_still_takes_its_options_by_position_and_by_name():
    model, _ = T.family_model("opt", layers=1)
    sch = schedlang.create_schedule(model)
    assert str(plan_tensor_parallel(sch, True)) == str(plan_tensor_parallel(sch, gather_logits=True))
    assert len(sch.plan) == 0  # a plan only: nothing applied

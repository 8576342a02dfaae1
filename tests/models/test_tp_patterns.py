"""The layouts ``shard_model`` meets across HF families: split correctly, or refused before any step stays.

At world 2 on gloo, inside Verify (outputs and every gradient against the unsplit model):

* a per-head bias the model passes to every attention (ALiBi: BLOOM, Falcon with ``alibi=True``) is cut to
  each rank's heads;
* the attention's own per-head parameters (gpt-oss's attention sinks) are split with the heads;
* routers and gates (projections feeding no other one) stay whole, beside a split shared expert (Qwen2-MoE);
* the experts of a mixture-of-experts block (3-D tensors) are split like dense MLPs (Mixtral, Qwen2-MoE), or
  kept whole where their layout cannot be split (gpt-oss: gate and up interleaved, a bias per expert);
* attention and MLP reading the same input in parallel (Phi) pass as they are;
* a norm over the whole q projection before the heads are split (OLMo-2) is refused up front, and the
  message's own recipe (keep that block whole, split the rest) passes;
* a layout only a run can tell (DiffLlama's heads regrouped in two) is refused by the fake-tensor run of
  the split model, naming the module, and the message's recipe passes too;
* a module called twice per forward in an order that depends on the process (Gemma-3's rotary embeddings)
  does not make Verify's cross-rank check fail.
"""

import inspect
import re

import pytest
import torch

import schedlang
from schedlang.distributed.shard_rules.per_head_bias import HeadBiasSlice, head_bias_arguments
from schedlang.models.family_configs import Family, example_ids, tiny_config
from schedlang.module_record import shard_specs
from tests.helpers.distributed import run_distributed
from tests.models import tp_checks as T


def _model(model_type: str, **changes):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = tiny_config(model_type)
    for key, value in changes.items():
        setattr(config, key, value)
    klass = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    if not getattr(klass, "_supports_sdpa", True):
        config._attn_implementation = "eager"
    torch.manual_seed(0)
    return klass(config), config


def _verified(model_type: str, **changes):
    from schedlang.models import shard_model

    model, config = _model(model_type, **changes)
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[example_ids(config)]) as check:
        plan = shard_model(sch)
    return sch, plan, check.report


def _alibi():
    out = {}
    for name, changes in (("bloom", {}), ("falcon", {"alibi": True})):
        sch, plan, report = _verified(name, **changes)
        attn = next(m for p, m in sch.mod.named_modules() if p.endswith("0.self_attention"))
        takes = inspect.signature(type(attn).forward).parameters
        out[name] = {"hooks": [repr(h) for h in attn._forward_pre_hooks.values() if isinstance(h, HeadBiasSlice)],
                     "compared": len(report.compared),
                     # Falcon before transformers 5.25 passes alibi beside the mask, from 5.25 on inside it
                     "bias_arguments": [n for n in ("alibi", "attention_mask") if n in takes]}
    return out


def _sinks():
    sch, plan, _ = _verified("gpt_oss")
    attn = sch["model.layers.0.self_attn"].mod
    return {"spec": shard_specs(attn)["sinks"], "local": tuple(attn.sinks.shape), "plan": str(plan)}


def _router_kept_whole():
    sch, plan, _ = _verified("qwen2_moe")
    return {"plan": str(plan), "gate": tuple(sch["model.layers.0.mlp.shared_expert_gate"].mod.weight.shape),
            "shared": tuple(sch["model.layers.0.mlp.shared_expert.gate_proj"].mod.weight.shape)}


def _experts():
    out = {}
    for name in ("mixtral", "qwen2_moe", "gpt_oss"):
        sch, plan, report = _verified(name)
        experts = sch["model.layers.0.mlp.experts"].mod
        out[name] = {"plan": str(plan), "specs": {n: (s.axis, s.groups, s.full_shape)
                                                  for n, s in shard_specs(experts).items()},
                     "hooks": [repr(h) for h in experts._forward_pre_hooks.values()],
                     "router_grads": [n for n in report.compared if "mlp.gate" in n and "gradient" in n]}
    return out


def _experts_built_on_the_meta_device():
    """The README's flow for a mixture of experts: a meta model, shard_model, build; against an unsharded build."""
    import transformers

    from schedlang.checkpoint import full_tensor
    from schedlang.distributed.collectives import all_gather_tensor
    from schedlang.models import shard_model

    config = tiny_config("mixtral")
    built = []
    for split in (True, False):
        with schedlang.init_empty_weights():
            meta = transformers.MixtralForCausalLM(config)
        sch = schedlang.create_schedule(meta, mesh=T.tp_mesh())  # DTensor parameters: placements are checked
        if split:
            shard_model(sch)
        torch.manual_seed(0)
        built.append(schedlang.build(sch)[0])
    split, whole = built
    experts, whole_experts = split.model.layers[0].mlp.experts, whole.model.layers[0].mlp.experts
    ids = example_ids(config)
    logits = all_gather_tensor(split(input_ids=ids).logits.contiguous(), -1)
    return {"placements": str(experts.gate_up_proj.placements), "local": tuple(experts.gate_up_proj.to_local().shape),
            "same_init": all(torch.equal(full_tensor(getattr(experts, n)), getattr(whole_experts, n).detach())
                             for n in ("gate_up_proj", "down_proj")),
            "logits": float((logits - whole(input_ids=ids).logits).abs().max())}


def _parallel_blocks():
    _, plan, _ = _verified("phi")
    return str(plan)


def _refused_then_recipe(model_type: str):
    """shard_model's refusal, then the recipe its message gives, run as written, inside Verify."""
    from schedlang.models import shard_model
    from schedlang.models.auto import apply_tensor_parallel, plan_tensor_parallel

    model, config = _model(model_type)
    ids = example_ids(config)
    sch = schedlang.create_schedule(model)
    out = {}
    try:
        shard_model(sch)
    except schedlang.SchedlangError as e:
        out["error"] = (type(e).__name__, str(e), isinstance(e, TypeError))
    out["steps_after_refusal"] = len(sch.plan)
    recipe = re.search(r"write: (plan = .*?apply_tensor_parallel\(sch, plan\))", out["error"][1]).group(1)
    with schedlang.Verify(sch, example_inputs=[ids]) as check:
        exec(recipe.replace("; ", "\n"), {"sch": sch, "plan_tensor_parallel": plan_tensor_parallel,
                                          "apply_tensor_parallel": apply_tensor_parallel})
    out["recipe_steps"] = len(sch.plan)
    out["compared"] = len(check.report.compared)
    return out


def _rotary_called_per_layer_kind():
    _, _, report = _verified("gemma3_text")
    return {"notes": report.notes}


def _world2(rank, world):
    return T.run_scenarios({
        "alibi": _alibi, "sinks": _sinks, "router": _router_kept_whole, "parallel": _parallel_blocks,
        "experts": _experts, "experts_built": _experts_built_on_the_meta_device,
        "olmo2": lambda: _refused_then_recipe("olmo2"), "diffllama": lambda: _refused_then_recipe("diffllama"),
        "gemma3": _rotary_called_per_layer_kind,
    })


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2, world_size=2, timeout=500)


def test_alibi_biases_are_cut_to_each_ranks_heads(world2):
    for rank, r in enumerate(T.value(world2, "alibi")):
        for name in ("bloom", "falcon"):
            first, last = 2 * rank, 2 * rank + 2
            assert "attention_mask" in r[name]["bias_arguments"]
            assert r[name]["hooks"] == [f"HeadBiasSlice({argument!r}, heads {first}..{last} of 4)"
                                        for argument in r[name]["bias_arguments"]], r[name]
            assert r[name]["compared"] > 0


def test_attention_sinks_are_split_with_the_heads(world2):
    for rank, r in enumerate(T.value(world2, "sinks")):
        assert (r["spec"].axis, r["spec"].rank, r["spec"].full_shape) == (0, rank, (4,))
        assert r["local"] == (2,)
        assert "per-head sinks split" in r["plan"], r["plan"]


def test_routers_stay_whole_beside_a_split_shared_expert(world2):
    for r in T.value(world2, "router"):
        assert "kept whole (their projections feed no other one): mlp" in r["plan"], r["plan"]
        assert r["gate"] == (1, T.HIDDEN)  # whole
        assert r["shared"] == (16, T.HIDDEN)  # 32 / 2 ranks


def test_experts_are_split_like_dense_mlps_and_their_routing_gradients_summed(world2):
    for r in T.value(world2, "experts"):
        mixtral = r["mixtral"]
        # (experts, 2 x 96, 64): gate and up each split, rank r keeps [gate_r, up_r]; down along its 96 inputs
        assert mixtral["specs"] == {"gate_up_proj": (1, 2, (4, 192, T.HIDDEN)), "down_proj": (2, 1, (4, T.HIDDEN, 96))}
        assert "InputGradientSync()" in mixtral["hooks"]
        assert "mlp.experts (experts): gate_up_proj, down_proj split along the intermediate width" in mixtral["plan"]
        assert mixtral["router_grads"], "the router's gradient was compared with the original's"
        qwen = r["qwen2_moe"]
        assert qwen["specs"]["gate_up_proj"] == (1, 2, (4, 64, T.HIDDEN)), qwen["specs"]
        assert "mlp.shared_expert (mlp)" in qwen["plan"], qwen["plan"]
        oss = r["gpt_oss"]
        assert oss["specs"] == {}
        assert "mlp.experts (experts): kept whole: gate and up are interleaved in gate_up_proj" in oss["plan"]


def test_experts_built_from_a_meta_model_hold_their_slices_of_the_unsharded_build(world2):
    for r in T.value(world2, "experts_built"):
        assert r["placements"] == "(_StridedShard(dim=1, sf=2),)" and r["local"] == (4, 96, T.HIDDEN)
        assert r["same_init"]
        assert r["logits"] < 1e-5, r


def test_parallel_attention_and_mlp_blocks_pass(world2):
    for plan in T.value(world2, "parallel"):
        assert "self_attn (attention)" in plan and "mlp (mlp)" in plan, plan


def test_a_norm_over_the_whole_projection_is_refused_up_front_and_its_recipe_passes(world2):
    for r in T.value(world2, "olmo2"):
        name, message, type_error = r["error"]
        assert name == "UnsupportedModelError" and type_error
        assert message.startswith(
            "model.layers.0.self_attn: shard_model cannot split this block of Olmo2ForCausalLM: "
            "model.layers.0.self_attn.q_norm (Olmo2RMSNorm) has weights over the whole output of q_proj (64 features, "
            "every head) and works on it whole: with the heads split over the ranks it would see only this rank's "
            "part (a norm's statistics would cover only its heads)"), message
        assert "plan.all_blocks = [b for b in plan.all_blocks if not b.unsupported]" in message
        assert r["steps_after_refusal"] == 0
        assert r["recipe_steps"] > 0 and r["compared"] > 0


def test_a_layout_only_a_run_tells_is_refused_by_the_fake_run_and_its_recipe_passes(world2):
    for r in T.value(world2, "diffllama"):
        name, message, _ = r["error"]
        assert name == "UnsupportedModelError"
        assert message.startswith(
            "model.layers.0.self_attn: shard_model cannot split DiffLlamaForCausalLM: split over 2 ranks, its "
            "DiffLlamaAttention raises ValueError: not enough values to unpack (expected 2, got 1) (found by running "
            "the split model on fake tensors; no step stays in the plan)"), message
        assert "plan.all_blocks = [b for b in plan.all_blocks if b.kind != 'attention']" in message
        assert r["steps_after_refusal"] == 0
        assert r["recipe_steps"] > 0


def test_a_module_called_per_layer_kind_does_not_fail_the_cross_rank_check(world2):
    for r in T.value(world2, "gemma3"):
        assert any("replicated tensors agree across ranks" in n for n in r["notes"]), r["notes"]


# ------------------------------------------------------------------------------------------ one process

@pytest.mark.parametrize("shape,expected", [
    ((4, 1, 5), lambda b: b[2:4]),  # (heads, 1, keys): MPT
    ((8, 1, 5), lambda b: b.reshape(2, 4, 1, 5)[:, 2:4].reshape(4, 1, 5)),  # (batch * heads, 1, keys): BLOOM
    ((2, 4, 3, 5), lambda b: b[:, 2:4]),  # (batch, heads, queries, keys)
])
def test_a_per_head_bias_is_cut_along_its_head_axis(shape, expected):
    bias = torch.randn(shape)
    hook = HeadBiasSlice("alibi", 1, heads=4, rank=1, world=2)
    args, kwargs = hook(torch.nn.Identity(), (), {"alibi": bias})
    torch.testing.assert_close(kwargs["alibi"], expected(bias))
    args, kwargs = hook(torch.nn.Identity(), ("x", bias), {})  # passed by position
    torch.testing.assert_close(args[1], expected(bias))


def test_a_mask_is_cut_only_where_it_holds_the_heads():
    hook = HeadBiasSlice("attention_mask", 1, heads=4, rank=1, world=2)
    per_head, broadcast = torch.randn(2, 4, 3, 3), torch.randn(2, 1, 3, 3)
    torch.testing.assert_close(hook(torch.nn.Identity(), (), {"attention_mask": per_head})[1]["attention_mask"],
                               per_head[:, 2:])
    assert hook(torch.nn.Identity(), (), {"attention_mask": broadcast})[1]["attention_mask"] is broadcast


def test_a_per_head_bias_without_a_head_axis_says_so():
    hook = HeadBiasSlice("alibi", 0, heads=4, rank=0, world=2)
    with pytest.raises(schedlang.ShardError, match=r"^Identity.forward argument 'alibi': a per-head bias of shape "
                                                   r"\(3, 5\) has no axis of 4 heads \(nor batch x 4\); register a "
                                                   r"shard rule for the attention that slices it$"):
        hook(torch.nn.Identity(), (torch.randn(3, 5),), {})


def test_per_head_bias_arguments_are_read_from_the_signature():
    import transformers.models.bloom.modeling_bloom as bloom
    import transformers.models.llama.modeling_llama as llama

    assert head_bias_arguments(bloom.BloomAttention) == [("alibi", 2), ("attention_mask", 3)]
    assert head_bias_arguments(llama.LlamaAttention) == []
    assert head_bias_arguments(llama.LlamaAttention, folds_alibi=True) == [("attention_mask", 2)]


@pytest.mark.parametrize("alibi", [True, False])
def test_an_alibi_model_whose_attention_takes_only_the_mask_gets_the_mask_cut(alibi):
    # Falcon from transformers 5.25 on adds ALiBi to the mask before its layers; its config says so
    from schedlang.distributed.shard_rules.per_head_bias import folds_alibi_into_mask

    model, _ = _model("falcon", alibi=alibi)
    attention = model.transformer.h[0].self_attention
    assert folds_alibi_into_mask(attention) is alibi
    names = [name for name, _ in head_bias_arguments(type(attention), folds_alibi_into_mask(attention))]
    # before 5.25 Falcon's attention takes an alibi argument (None without ALiBi), and the mask beside it
    takes_alibi = "alibi" in inspect.signature(type(attention).forward).parameters
    assert ("attention_mask" in names) is (alibi or takes_alibi)


def test_every_family_of_the_patterns_is_in_transformers_causal_lm_mapping():
    from schedlang.models.family_configs import causal_lm_families

    types = {f.model_type for f in causal_lm_families()}
    assert {"bloom", "falcon", "gpt_oss", "qwen2_moe", "phi", "olmo2", "diffllama", "gemma3_text"} <= types
    assert Family("llama", "LlamaForCausalLM").model_class().__name__ == "LlamaForCausalLM"


def test_experts_split_along_another_axis_or_interleaved_are_refused_naming_the_tensor():
    import contextlib
    from unittest import mock

    import schedlang.distributed.groups as groups

    import importlib
    import pkgutil

    import schedlang.distributed

    # modules bind groups.world_size when first imported: one imported under the patch would keep two ranks
    for info in pkgutil.walk_packages(schedlang.distributed.__path__, "schedlang.distributed."):
        importlib.import_module(info.name)

    @contextlib.contextmanager
    def two_ranks():
        with mock.patch.object(groups, "world_size", lambda group=None: 2), \
                mock.patch.object(groups, "rank", lambda group=None: 0):
            yield

    model, _ = _model("mixtral")
    with two_ranks():
        sch = schedlang.create_schedule(model)
        experts = sch["model.layers.0.mlp.experts"]
        with pytest.raises(schedlang.ShardError, match=(
                r"^model\.layers\.0\.mlp\.experts: cannot shard 'gate_up_proj' of MixtralExperts along axis 2: valid "
                r"is axis 1, the intermediate width of its experts$")):
            experts.shard("gate_up_proj", axis=2)
        assert len(sch.plan) == 0
        experts.mod.is_concatenated = False  # as if gate and up alternated
        with pytest.raises(schedlang.ShardError, match=(
                r"^model\.layers\.0\.mlp\.experts: cannot shard 'gate_up_proj' of MixtralExperts: gate and up are "
                r"interleaved in gate_up_proj; valid are gate_up_proj along axis 1, down_proj along axis 2 of experts "
                r"laid out as gate then up$")):
            experts.shard("gate_up_proj", axis=1)

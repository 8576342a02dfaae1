"""Tensor-parallel LLaMA (transformers 5.x) with ``schedlang.models.llama.shard_llama``, on 2 and 4 ranks.

Each rank holds a shard of attention (heads), MLP, embedding and LM head (vocabulary); logits,
loss and every gradient must equal the single-device model's (sharded gradients equal the
matching slices of the reference's). The ranks are spawned once per world size; every
scenario runs in that one launch and each test checks its own.
"""

import copy

import pytest
import torch
from torch.distributed.tensor import Shard

import schedlang
from schedlang import compat
from schedlang.distributed.sync_ops import SyncOp
from schedlang.models.llama import shard_llama
from schedlang.module_record import shard_specs
from tests.helpers.distributed import run_distributed
from tests.models import tp_checks as T

SEQ = 12


def _inputs(seq=SEQ):
    ids = torch.randint(0, T.VOCAB, (2, seq), device=T.device())
    labels = ids.clone()
    labels[0, :3] = -100  # ignored tokens count neither in the loss nor in its mean
    return ids, labels


def _model(**config):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(T.llama_config(**config)).to(T.device())


def _tp_vocab_parallel_loss():
    model = _model()
    ids, labels = _inputs()
    sch = schedlang.create_schedule(model)
    shard_llama(sch)
    built, _ = schedlang.build(sch)
    result = T.compare(built, copy.deepcopy(model), {"input_ids": ids, "labels": labels}, logits_split=True)
    attn = built.model.layers[0].self_attn
    result.update(heads=(attn.num_heads, attn.num_key_value_heads, attn.num_key_value_groups),
                  loss_function=type(built.loss_function).__name__,
                  n_params=len(list(model.named_parameters(remove_duplicate=False))))
    return result


def _tied_verify_and_gather():
    model = _model(tied=True)
    ids, labels = _inputs()
    sch = schedlang.create_schedule(model, mesh=T.tp_mesh())  # DTensor parameters: their placements are checked
    with schedlang.Verify(sch, example_inputs=[ids]):
        shard_llama(sch, gather_logits=True)
    built, _ = schedlang.build(sch)
    result = T.compare(built, copy.deepcopy(model), {"input_ids": ids, "labels": labels}, logits_split=False)
    result["tied"] = built.lm_head.weight is built.model.embed_tokens.weight
    result["head_rows"] = built.lm_head.weight.to_local().shape[0]
    result["head_placements"] = [str(p) for p in built.lm_head.weight.placements]
    return result


def _verify_catches_wrong_axis():
    model = _model()
    ids, _ = _inputs()
    sch = schedlang.create_schedule(model)
    try:
        with schedlang.Verify(sch, example_inputs=[ids]):
            mlp = sch["model.layers.0.mlp"]
            mlp["gate_proj"].shard("weight", axis=1)  # wrong: the gate must be split along its outputs
            mlp["up_proj"].shard("weight", axis=0)
            mlp["down_proj"].shard("weight", axis=1)
            mlp["down_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
            mlp.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    except schedlang.VerificationError as e:
        return str(e)
    return None


def _meta_build_matches_unsharded_build():
    from transformers import LlamaForCausalLM

    with schedlang.init_empty_weights():
        meta = LlamaForCausalLM(T.llama_config(tied=True))
    sch = schedlang.create_schedule(meta)
    shard_llama(sch)
    torch.manual_seed(7)
    sharded, _ = schedlang.build(sch, device=T.device())
    torch.manual_seed(7)
    full, _ = schedlang.build(schedlang.create_schedule(meta), device=T.device())
    ids, labels = _inputs()
    result = T.compare(sharded, full, {"input_ids": ids, "labels": labels}, logits_split=True)
    result["bytes_ratio"] = T.param_bytes(sharded) / T.param_bytes(full)
    result["meta_left"] = any(t.is_meta for t in list(sharded.parameters()) + list(sharded.buffers()))
    return result


def _tp_world4_sequence_parallel():
    model = _model(heads=4, kv_heads=4)
    ids, labels = _inputs(seq=16)
    sch = schedlang.create_schedule(model)
    shard_llama(sch, sequence_parallel=True)
    built, _ = schedlang.build(sch)
    return T.compare(built, copy.deepcopy(model), {"input_ids": ids, "labels": labels}, logits_split=True)


def _grad_sync_at_norm_and_compiled_layers():
    from schedlang.models import compile_layers

    out = {}
    # compiled_sp_checkpointed: every layer checkpointed; the backward's recompute runs the forward outside the
    # hooks that swap the compiled layer's DTensors for local tensors, and must see the local tensors too
    for name, grad_sync, trace in [("norm", "norm", None), ("compiled", "block", False),
                                   ("compiled_traced", "block", True), ("compiled_sp", "block", False),
                                   ("compiled_sp_checkpointed", "block", False)]:
        model = _model()
        ids, labels = _inputs()
        # the checkpointed variant holds DTensor parameters, as the trainer's models do
        sch = schedlang.create_schedule(model, mesh=T.tp_mesh() if name == "compiled_sp_checkpointed" else None)
        if name == "norm":
            with schedlang.Verify(sch, example_inputs=[ids]):
                shard_llama(sch, grad_sync=grad_sync, gather_logits=True)
            sch = schedlang.create_schedule(model)
        shard_llama(sch, grad_sync=grad_sync, sequence_parallel=name.startswith("compiled_sp"))
        if name == "compiled_sp_checkpointed":
            for i in range(len(model.model.layers)):
                sch[f"model.layers.{i}"].checkpoint()
        built, _ = schedlang.build(sch)
        if trace and not compat.TRACED_COLLECTIVES_KEEP_BACKWARD:
            try:
                compile_layers(built, trace_collectives=True)
            except schedlang.ScheduleValueError as e:
                out[name] = str(e)
                continue
        if trace is not None:
            assert compile_layers(built, trace_collectives=trace, backend="aot_eager") == 2
        out[name] = T.compare(built, copy.deepcopy(model), {"input_ids": ids, "labels": labels, "use_cache": False},
                              logits_split=True)
    return out


def _compiled_layers_share_graphs():
    """A tensor-parallel model's compiled layers share one set of graphs, however many layers there are: the
    DTensors become local tensors around each layer's call, outside the compiled code (a per-module hook inside
    it made torch.compile recompile every layer, and past its recompile limit run the rest eagerly). Layers
    compiled after build (``compile_layers(built)``) and before it (as ``optimize_model`` compiles the
    schedule's model) alike."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import LlamaForCausalLM

    from schedlang.distributed.dtensor_params import hoist_local_views, is_dtensor
    from schedlang.models import compile_layers

    out = {}
    for when in ("after_build", "before_build"):
        for layers in (1, 3):
            torch.manual_seed(0)
            model = LlamaForCausalLM(T.llama_config(layers=layers)).to(T.device())
            sch = schedlang.create_schedule(model, mesh=T.tp_mesh())  # DTensor parameters, their views hoisted
            shard_llama(sch)
            if when == "before_build":
                assert compile_layers(sch.mod, backend="eager") == layers
            built, _ = schedlang.build(sch)
            if when == "after_build":
                assert compile_layers(built, backend="eager") == layers
            torch._dynamo.reset()
            counters.clear()
            ids, labels = _inputs()
            built(input_ids=ids, labels=labels, use_cache=False).loss.backward()
            mlp = built.model.layers[0].mlp
            up = mlp.up_proj
            out[when, layers] = {
                "graphs": counters["stats"]["unique_graphs"],
                "hooks_inside": sum(len(m._forward_pre_hooks) for m in mlp.modules()
                                    if m is not mlp and not isinstance(m, SyncOp)),
                "dtensor_after": is_dtensor(up.weight) and is_dtensor(up.weight.grad)}
    # hoisting twice moves nothing more; a forward that raises still gives the DTensors back
    out["again"] = hoist_local_views(built.model.layers[0])

    def fail(*args, **kwargs):
        raise RuntimeError("planted")

    built.model.layers[0].mlp.down_proj.forward = fail
    try:
        built(input_ids=ids, labels=labels, use_cache=False)
    except RuntimeError as e:
        out["raised"] = str(e)
    out["dtensor_after_raise"] = is_dtensor(up.weight) and is_dtensor(built.model.layers[0].self_attn.q_proj.weight)
    return out


def _fused_projections():
    """``compile_layers(fuse_projections=True)`` on tensor-parallel layers (Inductor): each rank's q|k|v and
    gate|up shards run as one GEMM each, the layers still share one graph, and logits, loss and gradients stay
    the single-device model's."""
    from torch._dynamo.utils import counters

    from schedlang.graph.passes.shared_input_linears import COUNTER
    from schedlang.models import compile_layers
    from tests.helpers.compiling import no_compile_caches

    model = _model()
    ids, labels = _inputs()
    sch = schedlang.create_schedule(model)
    shard_llama(sch)
    built, _ = schedlang.build(sch)
    torch._dynamo.reset()
    counters.clear()
    assert compile_layers(built, fuse_projections=True) == 2
    with no_compile_caches():
        result = T.compare(built, copy.deepcopy(model), {"input_ids": ids, "labels": labels, "use_cache": False},
                           logits_split=True)
    result.update(fused=counters["schedlang"][COUNTER], graphs=counters["stats"]["unique_graphs"])
    return result


def _cuda_graph_layers():
    """``optimize_model(compile="layers-cudagraphs")`` on a tensor-parallel model: the layers' forward and
    backward, all-reduces included, are recorded as CUDA graphs and replayed; logits, loss and gradients stay
    the single-device model's on every call (the first records, the later ones replay)."""
    from schedlang.models import optimize_model
    from tests.helpers.devices import cudagraph_skip_messages, recorded_cuda_graphs

    model = _model()
    ids, labels = _inputs()
    torch._dynamo.reset()
    sch = schedlang.create_schedule(model)
    shard_llama(sch)
    optimize_model(sch, compile="layers-cudagraphs")
    built, _ = schedlang.build(sch)
    reference = copy.deepcopy(model)
    calls = []
    with cudagraph_skip_messages() as skipped:
        for _ in range(3):
            calls.append(T.compare(built, reference, {"input_ids": ids, "labels": labels, "use_cache": False},
                                   logits_split=True))
            for m in (built, reference):
                m.zero_grad(set_to_none=True)
    return {"calls": calls, "graphs": recorded_cuda_graphs(), "skipped": skipped,
            "applied": sch.metadata["optimize"]["applied"]}


def _world2(rank, world):
    return T.run_scenarios({
        "shared_graphs": _compiled_layers_share_graphs,
        "tp": _tp_vocab_parallel_loss,
        "tied": _tied_verify_and_gather,
        "wrong_axis": _verify_catches_wrong_axis,
        "meta": _meta_build_matches_unsharded_build,
        "variants": _grad_sync_at_norm_and_compiled_layers,
        "fused_projections": _fused_projections,
    })


def _world4(rank, world):
    return T.run_scenarios({"sp4": _tp_world4_sequence_parallel})


def _world2_cuda(rank, world):
    return T.run_scenarios({"cuda_graphs": _cuda_graph_layers})


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2, world_size=2, timeout=240)


def test_logits_loss_and_gradients_match_single_device(world2):
    for r in T.value(world2, "tp"):
        T.assert_matches(r)
        assert r["local_vocab"] == T.VOCAB // 2
        assert r["grads_compared"] == r["n_params"]
        assert r["heads"] == (2, 1, 2)  # 4 query heads, 2 key/value heads, over 2 ranks
        assert r["loss_function"] == "VocabParallelCausalLMLoss"


def test_tied_lm_head_stays_tied_and_verify_passes(world2):
    for r in T.value(world2, "tied"):
        T.assert_matches(r)
        assert r["tied"] is True
        assert r["head_rows"] == T.VOCAB // 2
        assert r["head_placements"] == [str(Shard(0))]


def test_verify_catches_wrong_shard_axis(world2):
    messages = T.value(world2, "wrong_axis")
    for m in messages:
        assert m is not None, "Verify accepted a gate projection split along its inputs"
        assert "does not match the original model" in m
        assert "shard at 'model.layers.0.mlp.gate_proj' (tensor_name='weight', axis=1)" in m


def test_meta_build_holds_half_the_parameters_and_matches_unsharded_build(world2):
    for r in T.value(world2, "meta"):
        T.assert_matches(r)
        assert r["meta_left"] is False
        # everything but the norms (5 x 64 of ~70k parameters) is split in two
        assert 0.5 <= r["bytes_ratio"] < 0.51


def test_four_ranks_with_sequence_parallelism():
    results = run_distributed(_world4, world_size=4, timeout=240)
    for r in T.value(results, "sp4"):
        T.assert_matches(r)
        assert r["local_vocab"] == T.VOCAB // 4


def test_gradient_sync_at_the_norm_and_compiled_layers_match_single_device(world2):
    for per_rank in T.value(world2, "variants"):
        for name, r in per_rank.items():
            if isinstance(r, str):  # torch < 2.13 refuses traced collectives
                assert r.startswith("compile_layers: trace_collectives=True needs torch >= 2.13"), r
                continue
            assert r["loss"] <= 2e-5 and r["grad"] <= 2e-5, (name, r)


def test_compiled_tensor_parallel_layers_share_their_graphs(world2):
    for r in T.value(world2, "shared_graphs"):
        for when in ("after_build", "before_build"):
            assert r[when, 1]["graphs"] == r[when, 3]["graphs"], (when, r)  # no recompilation per layer
            # the all-reduces are opaque operators inside the graph: one graph, no break at them
            assert r[when, 3]["graphs"] == 1, (when, r)
            assert r[when, 3]["hooks_inside"] == 0  # the local-view hooks moved up to the layer
            # parameters and gradients are DTensors again
            assert r[when, 1]["dtensor_after"] and r[when, 3]["dtensor_after"]
        assert r["again"] == 0
        assert r["raised"] == "planted" and r["dtensor_after_raise"]


def test_fused_projections_on_tensor_parallel_layers_match_single_device(world2):
    for r in T.value(world2, "fused_projections"):
        T.assert_matches(r)
        assert r["fused"] == 2 and r["graphs"] == 1  # q|k|v and gate|up, in the one graph both layers share


def test_shard_llama_rejects_an_unknown_grad_sync():
    sch = schedlang.create_schedule(_model())
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"shard_llama: invalid grad_sync 'input': valid are 'block', 'norm'"):
        shard_llama(sch, grad_sync="input")
    assert len(sch.plan) == 0


def test_compile_layers_needs_a_layer_list():
    from schedlang.models import compile_layers

    with pytest.raises(schedlang.ScheduleTypeError,
                       match=r"compile_layers: no layer list \(layers, h, layer\) found in Linear"):
        compile_layers(torch.nn.Linear(2, 2))


def test_traced_collectives_are_refused_before_torch_2_13():
    from unittest import mock

    import schedlang.models as models

    with mock.patch.object(compat, "TRACED_COLLECTIVES_KEEP_BACKWARD", False):
        with pytest.raises(schedlang.ScheduleValueError,
                           match=r"compile_layers: trace_collectives=True needs torch >= 2.13 \(this is .*\): older "
                                 r"compilers lose the backward all-reduce of traced collectives"):
            models.compile_layers(_model(), trace_collectives=True)


def test_model_schedule_errors():
    from transformers import GPT2Config, GPT2LMHeadModel

    from schedlang.models import shard_gpt2, shard_model

    with pytest.raises(schedlang.ScheduleTypeError,
                       match=r"<root>: Sequential does not look like a LLaMA model: no 'layers' ModuleList found "
                             r"within 4 levels"):
        shard_llama(schedlang.create_schedule(torch.nn.Sequential(torch.nn.Linear(2, 2))))
    with pytest.raises(schedlang.ScheduleTypeError,
                       match=r"<root>: no ready-made schedule for Sequential, and the automatic plan cannot handle it: "
                             r"no ModuleList of same-class layers holding projections. Write a schedule for the family "
                             r"\(tutorials/07_new_family.py shows how\) and register it with "
                             r"schedlang.models.register_family\('Sequential', fn\)"):
        shard_model(schedlang.create_schedule(torch.nn.Sequential()))
    sch = schedlang.create_schedule(_model())
    sch["model.layers.0.self_attn"].replace(torch.nn.Identity())
    with pytest.raises(schedlang.ScheduleTypeError,
                       match=r"^model.layers.0.self_attn: expected q_proj, k_proj, v_proj and o_proj in a LLaMA "
                             r"self_attn, found no submodules; for another layout, shard_model\(sch\) finds the plan "
                             r"from the model's code$"):
        shard_llama(sch)
    sch = schedlang.create_schedule(_model())
    sch["model.layers.1.mlp.up_proj"].replace(torch.nn.Identity())
    with pytest.raises(schedlang.ScheduleTypeError,
                       match=r"model.layers.1.mlp.up_proj: expected an nn.Linear or Conv1D, found Identity"):
        shard_llama(sch)
    # layer 0 was sharded before layer 1 failed: all of it is undone
    assert len(sch.plan) == 1 and sch.plan[0].primitive == "replace"
    assert not shard_specs(sch["model.layers.0.self_attn.q_proj"].mod)
    assert not any("_schedlang_sync" in n for n, _ in sch.mod.named_modules())
    sch = schedlang.create_schedule(_model())
    sch["model.layers.0.mlp.down_proj"].replace(torch.nn.Identity())
    with pytest.raises(schedlang.ScheduleTypeError,
                       match=r"model.layers.0.mlp.down_proj: expected an nn.Linear or Conv1D, found Identity"):
        shard_llama(sch)
    cross = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0,
                                       eos_token_id=0, add_cross_attention=True))
    with pytest.raises(schedlang.ScheduleTypeError,
                       match=r"transformer.h.0: GPT-2 blocks with cross-attention are not supported by shard_gpt2"):
        shard_gpt2(schedlang.create_schedule(cross))


@pytest.mark.multigpu(2)
def test_tensor_parallel_layers_replay_from_cuda_graphs_and_match_single_device():
    for r in T.value(run_distributed(_world2_cuda, world_size=2, timeout=300), "cuda_graphs"):
        assert "compile: 2 layers (CUDA graphs)" in r["applied"], r["applied"]
        assert r["skipped"] == []  # no graph of GPU work runs without its CUDA graph
        assert r["graphs"] >= 2  # a forward and a backward graph at least
        for call in r["calls"]:
            T.assert_matches(call, tol=1e-4)

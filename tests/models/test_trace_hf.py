"""Tracing transformers 5.x models (tiny configs, random weights): LLaMA, GPT-2, BERT.

Their old ``transformers.utils.fx`` tracer is gone; schedlang's tracer handles keyword
arguments, the KV cache, masks and rotary embeddings itself.
"""

import inspect

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import schedlang  # noqa: E402
from schedlang.errors import TraceError  # noqa: E402
from schedlang.graph import PH  # noqa: E402

VOCAB = 96


def _llama(impl, cls_name="LlamaForCausalLM"):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = impl
    return getattr(transformers, cls_name)(config).eval()


def _gpt2(impl, cls_name="GPT2LMHeadModel"):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    config._attn_implementation = impl
    return getattr(transformers, cls_name)(config).eval()


def _bert(impl, cls_name="BertModel"):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, max_position_embeddings=64)
    config._attn_implementation = impl
    return getattr(transformers, cls_name)(config).eval()


FAMILIES = {
    # factory, where q/k/v are computed (regex), how many such calls, the first layer's path
    "llama": (_llama, r"self_attn\.[qkv]_proj$", 6, "model.layers.0"),
    "gpt2": (_gpt2, r"attn\.c_attn$", 2, "transformer.h.0"),
    "bert": (_bert, r"attention\.self\.(query|key|value)$", 6, "encoder.layer.0"),
}


def _ids(batch=3, seq=11, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _main_output(out):
    return out["logits"] if "logits" in out else out["last_hidden_state"]


def _assert_same(model, traced, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    traced.zero_grad(set_to_none=True)
    if _takes_cache(model):  # both without a KV cache (the traced graphs are specialized on use_cache=False)
        kwargs = dict(kwargs, use_cache=False)
    ref, out = _main_output(model(ids, **kwargs)), _main_output(traced(ids, **kwargs))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    ref.backward(grad)
    out.backward(grad)
    ref_grads = dict(model.named_parameters())
    for name, p in traced.named_parameters():
        if ref_grads[name].grad is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _takes_cache(model):
    return isinstance(model, (transformers.LlamaPreTrainedModel, transformers.GPT2PreTrainedModel))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_whole_model_traces_hierarchically_and_finds_qkv(family, impl):
    make, qkv, n_qkv, layer = FAMILIES[family]
    model = make(impl)
    sch = schedlang.create_schedule(model)
    sch.trace()
    assert isinstance(sch.mod, fx.GraphModule) and isinstance(sch[layer].mod, fx.GraphModule)
    assert list(sch.mod.state_dict()) == list(model.state_dict())
    found = sch.find(qkv)
    assert len(found) == n_qkv
    assert all(path.startswith(layer.rsplit(".", 1)[0]) for path, _ in found)
    assert all(node.graph is sch[path].mod.graph for path, node in found)
    _assert_same(model, sch.mod, _ids())


@pytest.mark.parametrize("family,cls_name", [("llama", "LlamaModel"), ("gpt2", "GPT2Model"), ("bert", "BertModel")])
def test_base_models_trace_flat(family, cls_name):
    model = FAMILIES[family][0]("sdpa", cls_name)
    sch = schedlang.create_schedule(model)
    sch.trace(flatten=True)
    assert not any(isinstance(m, fx.GraphModule) for n, m in sch.mod.named_modules() if n)
    _assert_same(model, sch.mod, _ids(batch=2, seq=7))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_single_layer_traces_with_the_arguments_it_really_gets(family):
    make, qkv, n_qkv, layer = FAMILIES[family]
    model = make("sdpa")
    sch = schedlang.create_schedule(model)
    sch[layer].trace()
    assert isinstance(sch[layer].mod, fx.GraphModule) and not isinstance(sch.mod, fx.GraphModule)
    assert len(sch[layer].find(qkv)) == n_qkv // 2  # the names are relative to the layer now
    _assert_same(model, sch.mod, _ids())


def test_llama_rms_norm_chain_is_found_in_every_layer_and_fused():
    model = _llama("eager")
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[_ids()]):
        sch["model.layers.0"].trace()

        def rms_norm(x, weight):
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return weight * h.to(x.dtype)

        found = sch["model.layers.0"].find(rms_norm)
        assert [sg[0][0] for sg in found] == ["input_layernorm", "post_attention_layernorm"]
        sch["model.layers.0"].fuse(found, compiler="eager", name="RMSNorm")
    assert "RMSNorm_0" in dict(sch["model.layers.0.input_layernorm"].mod.named_children())


def test_llama_mlp_found_with_fuzzy_module_calls():
    model = _llama("sdpa")
    sch = schedlang.create_schedule(model)
    sch.trace()

    def swiglu(x):
        return schedlang.call_module("down_proj", F.silu(schedlang.call_module("gate_proj", x))
                                     * schedlang.call_module("up_proj", x))

    found = sch.find(swiglu)
    assert [sg[0][0] for sg in found] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert [n.name for _, n in found[0]] == ["gate_proj", "act_fn", "up_proj", "mul", "down_proj"]


def test_masks_are_specialized_and_guarded_unless_made_inputs():
    model = _llama("sdpa")
    ids = _ids(batch=2, seq=9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    sch = schedlang.create_schedule(model)
    sch.trace()
    with pytest.raises(TraceError, match=r"^<root>: the graph was traced with attention_mask=None and cannot take "
                                         r"attention_mask=a tensor of shape \(2, 9\)"):
        sch.mod(ids, attention_mask=mask)
    sch = schedlang.create_schedule(model)
    sch.trace(concrete_args={"attention_mask": PH})
    _assert_same(model, sch.mod, ids, attention_mask=mask)


def test_gpt2_mask_input_gets_a_synthesized_example_for_its_rank_test():
    # GPT-2 tests `attention_mask.ndim < 4` in Python: the mask needs an example value,
    # which schedlang makes up for an HF model's token-level inputs
    model = _gpt2("eager")
    mask = torch.ones(3, 11)
    mask[1, :4] = 0
    for concrete in ({"attention_mask": PH}, {"attention_mask": torch.ones(2, 8)}):
        sch = schedlang.create_schedule(model)
        sch.trace(concrete_args=concrete)
        _assert_same(model, sch.mod, _ids(), attention_mask=mask)


def test_hf_plan_replays_on_a_fresh_model():
    model = _bert("eager")
    sch = schedlang.create_schedule(model)
    sch.trace()
    replayed = schedlang.replay(sch.plan.to_json(), _bert("eager"))
    assert replayed.mod.code == sch.mod.code
    assert replayed["encoder.layer.1.attention.self"].mod.code == sch["encoder.layer.1.attention.self"].mod.code


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_bert_padding_mask_input_with_and_without_padding(impl):
    # HF drops an all-ones mask at run time; the traced graph must still attend correctly
    model = _bert(impl)
    sch = schedlang.create_schedule(model)
    sch.trace(concrete_args={"attention_mask": PH})
    ids = _ids(batch=3, seq=10)
    padded = torch.ones(3, 10, dtype=torch.long)
    padded[2, 6:] = 0
    for mask in (torch.ones(3, 10, dtype=torch.long), padded):
        _assert_same(model, sch.mod, ids, attention_mask=mask)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_retracing_a_traced_model_flat_keeps_attention_causal(family):
    # the second trace goes through generated code, where the attention kernel and the mask
    # builder are called by name: they must stay single calls (is_causal is decided at run time)
    model = FAMILIES[family][0]("sdpa")
    sch = schedlang.create_schedule(model)
    sch.trace()
    sch.trace(flatten=True)
    assert not any(isinstance(m, fx.GraphModule) for n, m in sch.mod.named_modules() if n)
    assert "scaled_dot_product_attention(" not in sch.mod.code  # still inside the sdpa leaf
    _assert_same(model, sch.mod, _ids())


def _with_dropout(family, impl):
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                         bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1,
                                         attn_pdrop=0.2)
        config._attn_implementation = impl
        return transformers.GPT2LMHeadModel(config).train(), "transformer.h.0"
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, max_position_embeddings=64, hidden_dropout_prob=0.1,
                                     attention_probs_dropout_prob=0.2)
    config._attn_implementation = impl
    return transformers.BertModel(config).train(), "encoder.layer.0"


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_a_block_with_attention_dropout_traced_in_training_mode_follows_the_mode(family, impl):
    # transformers passes dropout=p if self.training else 0.0 to its attention kernel: the traced call
    # now takes the constant of the mode it runs in, where it used to keep the training-mode dropout
    model, block = _with_dropout(family, impl)
    sch = schedlang.create_schedule(model)
    sch[block].trace()
    assert not any(m._forward_pre_hooks for m in sch[block].mod.modules())
    ids = _ids()
    for training in (True, False, True):
        model.train(training)
        sch.mod.train(training)
        torch.manual_seed(5)
        ref = _main_output(model(ids))
        torch.manual_seed(5)
        torch.testing.assert_close(_main_output(sch.mod(ids)), ref, rtol=1e-5, atol=1e-5)
    model.eval()
    sch.mod.eval()
    _assert_same(model, sch.mod, ids)


def test_verify_checks_a_gpt2_block_with_dropout_traced_in_training_mode_in_both_modes():
    import warnings

    model, block = _with_dropout("gpt2", "sdpa")
    sch = schedlang.create_schedule(model)
    verify = schedlang.Verify(sch, example_inputs=[_ids()])
    with warnings.catch_warnings():
        warnings.simplefilter("error", schedlang.verify.VerifyWarning)
        with verify:
            sch[block].trace()
    assert any(c.startswith("training mode: ") for c in verify.report.compared)
    assert any(not c.startswith("training mode: ") and not c.startswith("buffer") for c in verify.report.compared)


def test_llama_traces_to_the_same_graph_in_both_modes_without_checks():
    # LLaMA's attention passes dropout=0.0 in both modes and unpacks only shapes: its graphs get no mode
    # modules, no mode guard and no run-time checks, so what the benchmarks compile is what it was
    model = _llama("sdpa").train()
    sch = schedlang.create_schedule(model)
    sch.trace()
    graphs = [m for m in sch.mod.modules() if isinstance(m, fx.GraphModule)]
    assert len(graphs) > 4
    assert not any(isinstance(m, schedlang.graph.ModeDependentCall) for m in sch.mod.modules())
    assert not any(m._forward_pre_hooks for m in graphs)
    assert not any(getattr(n.target, "__name__", "").startswith("check_traced") for m in graphs for n in m.graph.nodes)
    model.eval()
    sch.mod.eval()
    _assert_same(model, sch.mod, _ids())


def test_a_submodule_of_a_meta_model_traces_with_examples_on_one_device():
    """GPT-Neo's attention built under init_empty_weights (meta weights, its causal-mask buffer on the CPU), traced
    alone with Slapo's config= for the example of hidden_states: every example is a CPU fake, so the mask value
    taken from ``torch.finfo(attn_weights.dtype)`` is known (torch before 2.13 refuses meta beside CPU fakes)."""
    from transformers import GPTNeoConfig, GPTNeoModel

    config = GPTNeoConfig(hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                          vocab_size=128, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, use_cache=False)
    with schedlang.init_empty_weights():
        model = GPTNeoModel(config)
    sch = schedlang.create_schedule(model)
    attention = sch["h.0.attn.attention"]
    parameters = inspect.signature(attention.mod.forward).parameters.values()
    attention.trace(recursive=False, flatten=True, tracer="huggingface", config=config,
                    concrete_args={p.name: p.default for p in parameters if p.name != "hidden_states"})
    graph = attention.mod.graph
    assert {"q_proj", "k_proj", "v_proj", "out_proj"} <= {n.target for n in graph.nodes if n.op == "call_module"}
    assert any(n.target is torch.where for n in graph.nodes)
    assert all(p.is_meta for p in attention.mod.parameters())  # the weights stay as they were


# families whose attention calls apply_rotary_pos_emb through transformers' kernel-hub decorators; with the
# `kernels` package installed that function is a module-level nn.Module and each attention routes its calls to
# private copies kept out of its submodules, which the tracer must trace through (without it, a plain function)
ROTARY_ATTENTION = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),  # q/k norms before the rotation
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 16, "sliding_window": 5}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
}
DTYPE_TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2)}


def _rotary_model(family, dtype, training):
    config_name, model_name, extra = ROTARY_ATTENTION[family]
    config = getattr(transformers, config_name)(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=64, use_cache=False, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).to(dtype).train(training)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("family", sorted(ROTARY_ATTENTION))
def test_rotary_attention_traces_alone_and_matches_eager(family, training, dtype):
    from schedlang.graph.tracer.foreign_modules import OpaqueModuleCall

    model = _rotary_model(family, dtype, training)
    sch = schedlang.create_schedule(model)
    sch["model.layers.0.self_attn"].trace()
    graph = sch["model.layers.0.self_attn"].mod.graph
    calls = [n.target for n in graph.nodes if n.op == "call_function"]
    # the rotation's operations are in the graph (rotate_half's cat, once for q and once for k), not one opaque call
    assert calls.count(torch.cat) == 2 and not any(isinstance(t, OpaqueModuleCall) for t in calls)
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= {n.target for n in graph.nodes if n.op == "call_module"}
    ids = _ids(batch=3, seq=11)
    tol = DTYPE_TOLERANCES[dtype]
    for run in (model, sch.mod):
        run.zero_grad(set_to_none=True)
    ref, out = model(ids).logits, sch.mod(ids).logits
    torch.testing.assert_close(out, ref, **tol)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref.backward(grad)
    out.backward(grad)
    ref_grads = dict(model.named_parameters())
    for name, p in sch.mod.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, **tol, msg=lambda m: f"{name}: {m}")


def test_rotary_attention_is_found_by_its_rotation():
    model = _rotary_model("llama", torch.float32, False)
    sch = schedlang.create_schedule(model)

    def rotate_half_and_mix(x, cos, sin):  # the half size read twice, as transformers' rotate_half does
        return x * cos + torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1) * sin

    found = sch["model.layers.0.self_attn"].find(rotate_half_and_mix)
    assert len(found) == 2  # q and k

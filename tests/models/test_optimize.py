"""``schedlang.models.optimize_model`` on tiny LLaMA and GPT-2 models on the CPU.

The optimized model trains like the plain one: the loss of each of three AdamW steps matches
(fp32), whether the fused kernels from ``schedlang.kernels`` are there or their plain fallback runs.
"""

import copy
import logging

import pytest
import torch

import schedlang
from schedlang.errors import SchedlangError
from schedlang.models import optimize, optimize_model
from schedlang.models.optimize import FusedLinearCrossEntropyHead

SEQ = 13


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=88, vocab_size=97, max_position_embeddings=32)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=48, n_head=4, vocab_size=97, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg)


def _batch(vocab):
    ids = torch.randint(0, vocab, (3, SEQ))
    labels = ids.clone()
    labels[1, 5:] = -100  # padding-like positions count neither in the sum nor in the mean
    return ids, labels


def _train(model, ids, labels, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def _assert_same_gradients(built, reference_model, ids, labels):
    """One more backward on both models; every gradient matches, relative to its largest entry."""
    for m in (built, reference_model):
        m(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    expected = dict(reference_model.named_parameters())
    grads = {name: p.grad for name, p in built.named_parameters()}
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        scale = float(expected[name].grad.abs().max())
        torch.testing.assert_close(grad, expected[name].grad, rtol=1e-3, atol=1e-4 * scale,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_three_steps_match_the_plain_model(make):
    model = make()
    ids, labels = _batch(model.config.vocab_size)
    reference_model = copy.deepcopy(model)
    reference = _train(reference_model, ids, labels)
    sch = schedlang.create_schedule(model)
    optimize_model(sch, compile=None, selective_checkpoint="all")
    built, _ = schedlang.build(sch)
    assert isinstance(built.lm_head, FusedLinearCrossEntropyHead)
    if make is _gpt2:  # the head keeps its tie to the embedding
        assert built.lm_head.weight is built.transformer.wte.weight
    info = sch.metadata["optimize"]
    assert any(a.startswith("loss:") for a in info["applied"]), info
    assert any(a.startswith("checkpoint: 2 of 2") for a in info["applied"]), info
    if make is _llama and optimize._kernel("FusedRMSNorm")[0] is not None:
        assert "norms: 5 x LlamaRMSNorm -> FusedRMSNorm" in info["applied"], info
    embed_path = "model.embed_tokens" if make is _llama else "transformer.wte"
    assert f"embedding: {embed_path} -> FusedEmbedding (its weight's gradient from deterministic Triton kernels)" \
        in info["applied"], info
    assert type(built.get_input_embeddings()).__name__ == "FusedEmbedding"
    assert type(model.get_input_embeddings()) is torch.nn.Embedding
    torch.testing.assert_close(_train(built, ids, labels), reference, rtol=1e-5, atol=1e-5)
    # and the gradients themselves (AdamW's steps do not change when a gradient is scaled, so the losses alone
    # would not notice a head whose weight gradient is off by a constant factor)
    _assert_same_gradients(built, reference_model, ids, labels)
    # the user's model is untouched
    assert not isinstance(model.lm_head, FusedLinearCrossEntropyHead)


@pytest.mark.gpu
def test_layers_replayed_from_cuda_graphs_train_as_the_plain_model():
    """``compile="layers-cudagraphs"``: four AdamW steps give the plain model's losses, the layers' forward
    and backward are recorded as CUDA graphs (none skipped), and the gradients the replays write are the
    plain model's."""
    from tests.helpers.devices import cudagraph_skip_messages, recorded_cuda_graphs

    torch.manual_seed(0)
    model = _llama().cuda()
    ids, labels = (t.cuda() for t in _batch(model.config.vocab_size))
    reference_model = copy.deepcopy(model)
    reference = _train(reference_model, ids, labels, steps=4)
    torch._dynamo.reset()
    sch = schedlang.create_schedule(model)
    optimize_model(sch, compile="layers-cudagraphs")
    built, _ = schedlang.build(sch)
    with cudagraph_skip_messages() as skipped:
        losses = _train(built, ids, labels, steps=4)
    torch.testing.assert_close(losses, reference, rtol=1e-4, atol=1e-4)
    assert skipped == []  # no graph of GPU work runs without its CUDA graph
    assert recorded_cuda_graphs() >= 2  # at least one forward and one backward graph
    # a fifth backward, replayed: the gradients the graphs wrote are the plain model's
    _assert_same_gradients(built, reference_model, ids, labels)


def test_logits_without_labels_and_none_with_them():
    model = _llama()
    ids, labels = _batch(model.config.vocab_size)
    sch = schedlang.create_schedule(model)
    optimize_model(sch, compile=None)
    built, _ = schedlang.build(sch)
    torch.testing.assert_close(built(input_ids=ids, use_cache=False).logits, model(input_ids=ids, use_cache=False).logits)
    out = built(input_ids=ids, labels=labels, use_cache=False)
    assert out.logits is None
    torch.testing.assert_close(out.loss, model(input_ids=ids, labels=labels, use_cache=False).loss)
    # the flag does not leak into the next call
    assert built(input_ids=ids, use_cache=False).logits.shape == (3, SEQ, model.config.vocab_size)


def test_parts_are_recorded_in_the_plan_and_compile_is_lazy():
    model = _llama()
    sch = schedlang.create_schedule(model)
    optimize_model(sch, compile="layers")
    steps = [step.primitive for step in sch.plan]
    assert "replace" in steps  # the head
    built, _ = schedlang.build(sch)
    for layer in built.model.layers:
        assert "forward" in layer.__dict__  # compiled on the first call
    assert sch.metadata["optimize"]["sdpa_backend"] is None  # CPU: PyTorch's default
    assert "sdpa" in sch.metadata["optimize"]["skipped"]


def test_projections_fused_in_the_compiled_layers_train_as_the_plain_model():
    """``fuse_projections=True``: the one graph the layers share runs q|k|v and gate|up as one GEMM each, and
    three AdamW steps give the plain model's losses; the parameters are the model's own."""
    from torch._dynamo.utils import counters

    from schedlang.graph.passes.shared_input_linears import COUNTER
    from tests.helpers.compiling import no_compile_caches

    model = _llama()
    ids, labels = _batch(model.config.vocab_size)
    reference = _train(copy.deepcopy(model), ids, labels)
    torch._dynamo.reset()
    counters.clear()
    sch = schedlang.create_schedule(model)
    optimize_model(sch, fuse_projections=True)
    assert "compile: 2 layers, linears on one input as one GEMM" in sch.metadata["optimize"]["applied"]
    built, _ = schedlang.build(sch)
    assert {n for n, _ in built.named_parameters()} == {n for n, _ in model.named_parameters()}
    with no_compile_caches():
        losses = _train(built, ids, labels)
    torch.testing.assert_close(losses, reference, rtol=1e-4, atol=1e-4)
    assert counters["schedlang"][COUNTER] == 2


@pytest.mark.parametrize("compiled_norms, kernel_calls_per_step", [("kernel", 5), ("inductor", 1)])
def test_compiled_layers_run_the_norm_kernels_or_inductors_code_and_train_as_the_plain_model(
        monkeypatch, compiled_norms, kernel_calls_per_step):
    """``compiled_norms="kernel"``: the compiled layers call schedlang's RMSNorm kernels (2 layers x 2 norms,
    and the final norm outside them: 5 forward launches per step); ``"inductor"`` (the default): only the
    final norm does. Both give the plain model's losses over three AdamW steps."""
    import importlib

    from tests.helpers.compiling import no_compile_caches

    kernel = importlib.import_module("schedlang.kernels.rms_norm")  # the module, not the function it exports
    launches = []
    forward = kernel._forward
    monkeypatch.setattr(kernel, "_forward", lambda *a, **k: launches.append(1) or forward(*a, **k))
    model = _llama()
    ids, labels = _batch(model.config.vocab_size)
    reference = _train(copy.deepcopy(model), ids, labels)
    launches.clear()
    torch._dynamo.reset()
    sch = schedlang.create_schedule(model)
    optimize_model(sch, compiled_norms=compiled_norms)
    assert all(m.compiled == compiled_norms for m in sch.mod.modules() if type(m).__name__ == "FusedRMSNorm")
    built, _ = schedlang.build(sch)
    with no_compile_caches():
        losses = _train(built, ids, labels)
    torch.testing.assert_close(losses, reference, rtol=1e-4, atol=1e-4)
    assert len(launches) == 3 * kernel_calls_per_step


def test_compile_options_reach_every_layer_with_the_cuda_graph_mode_spelled_out(monkeypatch):
    """torch.compile takes a mode or options, not both: with ``"layers-cudagraphs"`` and options of the caller's,
    each layer gets the mode's options spelled out under the caller's ones."""
    calls = []

    def recording_compile(fn, **kwargs):
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", recording_compile)
    sch = schedlang.create_schedule(_llama())
    optimize_model(sch, compile="layers-cudagraphs",
                   compile_options={"dynamic": False, "options": {"coordinate_descent_tuning": True}})
    assert len(calls) == 2  # one per layer
    for kwargs in calls:
        assert set(kwargs) == {"dynamic", "options"} and kwargs["dynamic"] is False
        assert kwargs["options"]["triton.cudagraphs"] is True and kwargs["options"]["coordinate_descent_tuning"]
    applied = sch.metadata["optimize"]["applied"]
    assert any(a.startswith("compile: 2 layers (CUDA graphs) with {'dynamic': False") for a in applied), applied


def test_missing_kernels_fall_back_with_a_reason(monkeypatch, caplog):
    monkeypatch.setattr(optimize, "_kernel", lambda name: (None, f"schedlang.kernels has no {name}"))
    model = _llama()
    ids, labels = _batch(model.config.vocab_size)
    sch = schedlang.create_schedule(model)
    with caplog.at_level(logging.INFO, logger="schedlang.models.optimize"):
        optimize_model(sch, compile=None)
        built, _ = schedlang.build(sch)
        loss = built(input_ids=ids, labels=labels, use_cache=False).loss
    assert sch.metadata["optimize"]["skipped"]["norms"] == "schedlang.kernels has no FusedRMSNorm"
    assert sch.metadata["optimize"]["skipped"]["embedding"] == "schedlang.kernels has no FusedEmbedding"
    assert "schedlang.kernels has no FusedRMSNorm" in caplog.text
    torch.testing.assert_close(loss, model(input_ids=ids, labels=labels, use_cache=False).loss)
    assert "loss: lm_head -> fused linear + cross entropy (fallback: schedlang.kernels has no " \
           "fused_linear_cross_entropy)" in sch.metadata["optimize"]["applied"]


class _ScaledEmbedding(torch.nn.Embedding):
    """An embedding that computes more than the lookup (as Gemma's scaled word embeddings do)."""

    def forward(self, ids):
        return super().forward(ids) * 2.0


@pytest.mark.parametrize("change, reason", [
    (lambda m: setattr(m.model, "embed_tokens", _ScaledEmbedding(97, 48)),
     "the input embedding 'model.embed_tokens' is a _ScaledEmbedding, not a plain nn.Embedding (a scaled or sharded "
     "embedding computes more than the lookup); kept"),
    (lambda m: setattr(m.model.embed_tokens, "scale_grad_by_freq", True),
     "the input embedding 'model.embed_tokens' sets max_norm, scale_grad_by_freq or sparse, which FusedEmbedding "
     "does not compute; kept"),
    (lambda m: m.model.embed_tokens.register_forward_hook(lambda mod, args, out: None),
     "the input embedding 'model.embed_tokens' is sharded or hooked; kept"),
], ids=["subclass", "scale-grad-by-freq", "hooked"])
def test_an_embedding_that_computes_more_than_the_lookup_is_kept_with_a_reason(change, reason):
    model = _llama()
    change(model)
    kept = type(model.model.embed_tokens)
    sch = schedlang.create_schedule(model)
    optimize_model(sch, compile=None)
    assert sch.metadata["optimize"]["skipped"]["embedding"] == reason
    built, _ = schedlang.build(sch)
    assert type(built.model.embed_tokens) is kept


@pytest.mark.parametrize("kwargs, message", [
    ({"compile": "model"}, "optimize_model: invalid compile 'model': valid are 'layers', 'layers-cudagraphs' or None"),
    ({"sdpa_backend": "fast"}, "optimize_model: invalid sdpa_backend 'fast': valid are auto, default, cudnn, "
                               "flash, efficient, math"),
    ({"float8": "e4m3"}, "optimize_model: invalid float8 'e4m3': valid are None, 'tensorwise', 'rowwise'"),
    ({"selective_checkpoint": 0}, "optimize_model: invalid selective_checkpoint 0: valid are None, 'all' or a "
                                  "positive int n (every n-th layer)"),
    ({"fuse_projections": "qkv"}, "optimize_model: fuse_projections must be True or False, got 'qkv'"),
    ({"compiled_norms": "triton"}, "optimize_model: invalid compiled_norms 'triton': valid are 'inductor', 'kernel'"),
    ({"compile_options": ["max-autotune"]}, "optimize_model: compile_options must be a dict of torch.compile "
                                            "arguments or None, got list"),
    ({"compile_options": {"dynamic": False}, "compile": None}, "optimize_model: compile_options were given, but "
                                                               "compile=None compiles nothing; pass "
                                                               "compile='layers' or 'layers-cudagraphs'"),
    ({"fuse_projections": True, "compile": None}, "optimize_model: fuse_projections=True rewrites the compiled "
                                                  "layers' graphs, but compile=None compiles none; pass "
                                                  "compile='layers' or 'layers-cudagraphs'"),
    # torch.compile's own refusals came only at the first layer, after the norms and the head were replaced
    ({"compile_options": {"mode": "nope"}}, "optimize_model: invalid torch.compile mode 'nope' in compile_options: "
                                            "valid modes are " + ", ".join(torch._inductor.list_mode_options())),
    ({"compile_options": {"bogus": 1}}, "optimize_model: unknown torch.compile argument 'bogus' in compile_options; "
                                        "valid are torch.compile's keyword arguments: fullgraph, dynamic, backend, "
                                        "mode, options, " + ".*"),
    ({"compile_options": {"options": ["max_autotune"]}}, "optimize_model: torch.compile's options in compile_options "
                                                         "must be a dict of Inductor settings (e.g. "
                                                         "{'coordinate_descent_tuning': True}), got list"),
    ({"compile_options": {"backend": "no-such-backend"}}, "optimize_model: invalid torch.compile backend "
                                                          "'no-such-backend' in compile_options: valid are a callable "
                                                          "or a registered name such as .*inductor.*"),
    ({"compile_options": {"backend": "eager", "options": {"x": 1}}, "compile": "layers-cudagraphs"},
     "optimize_model: compile_options name both a mode ('reduce-overhead') and options, which torch.compile refuses "
     "for backend 'eager' (only Inductor's mode options can be merged into them); give one of the two"),
])
def test_bad_options_are_refused_and_nothing_is_applied(kwargs, message):
    sch = schedlang.create_schedule(_llama())
    pattern = message.replace("(", r"\(").replace(")", r"\)").replace("{", r"\{").replace("}", r"\}")
    with pytest.raises(SchedlangError, match="^" + pattern + "$") as info:
        optimize_model(sch, **kwargs)
    assert isinstance(info.value, ValueError)
    assert len(sch.plan) == 0


def test_a_compiler_failure_at_a_later_layer_leaves_nothing_applied(monkeypatch):
    """What fails when the layers are compiled (after the norms, the head and the first layer were changed)
    undoes the whole call: no step in the plan, no layer compiled, nothing in the metadata."""
    compiled = []

    def compile_failing_at_the_second_layer(fn, **kwargs):
        if compiled:
            raise RuntimeError("compiler crashed")
        compiled.append(fn)
        return fn

    monkeypatch.setattr(torch, "compile", compile_failing_at_the_second_layer)
    sch = schedlang.create_schedule(_llama())
    with pytest.raises(RuntimeError, match="^compiler crashed$"):
        optimize_model(sch)
    assert len(compiled) == 1 and len(sch.plan) == 0 and "optimize" not in sch.metadata
    assert not isinstance(sch["lm_head"].mod, FusedLinearCrossEntropyHead)
    for layer in sch["model.layers"].mod:
        assert "forward" not in layer.__dict__  # neither compiled nor hoisted
        assert not layer._forward_hooks and not layer._forward_pre_hooks


def test_a_mode_next_to_options_reaches_inductor_as_options(monkeypatch):
    """torch.compile refuses a mode together with options, also mode "default" and an empty options dict:
    with Inductor the mode's own options are spelled out under the caller's, as for "layers-cudagraphs"."""
    from schedlang.models import compile_layers

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    compile_layers(_llama(), mode="default", options={"coordinate_descent_tuning": True})
    compile_layers(_llama(), mode="reduce-overhead", options={})
    assert calls == [{"options": {"coordinate_descent_tuning": True}}] * 2 + [{"options": {"triton.cudagraphs": True}}] * 2


def test_a_model_without_layers_is_refused():
    sch = schedlang.create_schedule(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(SchedlangError, match="optimize_model: no layer list .* found in Sequential"):
        optimize_model(sch)


def test_under_autocast_the_head_projects_in_the_autocast_dtype():
    model = _llama()
    ids, labels = _batch(model.config.vocab_size)
    sch = schedlang.create_schedule(model)
    optimize_model(sch, compile=None)
    built, _ = schedlang.build(sch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = built(input_ids=ids, labels=labels, use_cache=False).loss
        want = model(input_ids=ids, labels=labels, use_cache=False).loss
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    got.backward()
    want.backward()
    assert built.lm_head.weight.grad.dtype == torch.float32
    expected = dict(model.named_parameters())
    for name, p in built.named_parameters():
        # bf16 products on both sides, rounded in different places: bf16 tolerances relative to the largest entry
        # (these gradients are far below 1, so an absolute 2e-2 would accept anything)
        scale = expected[name].grad.abs().max().item()
        torch.testing.assert_close(p.grad / scale, expected[name].grad / scale, rtol=2e-2, atol=2e-2, msg=name)


def test_pinned_attention_backend_is_compiled_into_the_layer_without_graph_breaks(monkeypatch):
    """The backend pin wraps the layer's forward first and is compiled with it: one graph per layer, the same
    loss and gradients as the plain model."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    compiled = []
    real_compile = torch.compile

    def compile_on_aot_eager(fn, **options):  # Inductor's C++ build is slow on the CPU; dynamo is what counts
        compiled.append(fn)
        return real_compile(fn, backend="aot_eager", **options)

    monkeypatch.setattr(torch, "compile", compile_on_aot_eager)
    model = _llama()
    ids, labels = _batch(model.config.vocab_size)
    sch = schedlang.create_schedule(model)
    optimize_model(sch, compile="layers", sdpa_backend="math")
    assert sch.metadata["optimize"]["sdpa_backend"] == "math"
    assert all(isinstance(fn, optimize._WithSDPABackend) for fn in compiled) and len(compiled) == len(
        model.model.layers)
    built, _ = schedlang.build(sch)
    torch._dynamo.reset()
    counters.clear()
    loss = built(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    assert dict(counters["graph_break"]) == {}
    ref = model(input_ids=ids, labels=labels, use_cache=False).loss
    ref.backward()
    torch.testing.assert_close(loss, ref)
    for (name, p), q in zip(built.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("layout", optimize.SDPA_LAYOUTS)
def test_the_attention_probe_feeds_sdpa_the_models_own_layout(layout):
    """The probe's q, k, v have the strides the model hands SDPA; their gradients reach its leaves."""
    b, h, s, d = 2, 3, 5, 8
    leaves, (q, k, v), grad = optimize._probe_inputs(b, h, s, d, torch.float32, torch.device("cpu"), layout,
                                                     torch.Generator().manual_seed(0))
    assert all(t.shape == (b, h, s, d) for t in (q, k, v, grad))
    contiguous = layout == "heads-first"
    assert all(t.is_contiguous() == contiguous for t in (q, k, v, grad))
    if layout == "fused-qkv":  # slices of one projection: a row of q is 3 * h * d apart from the next
        assert len(leaves) == 1 and q.stride() == (s * 3 * h * d, d, 3 * h * d, 1)
        assert {t.untyped_storage().data_ptr() for t in (q, k, v)} == {leaves[0].untyped_storage().data_ptr()}
    elif layout == "per-projection":
        assert len(leaves) == 3 and q.stride() == (s * h * d, d, h * d, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out, leaves, grad)
    assert all(g.shape == t.shape and g.abs().sum() > 0 for g, t in zip(grads, leaves))


def test_each_family_is_probed_in_its_layout_and_a_bad_layout_is_refused():
    assert optimize._attention_shapes(_gpt2().config)["layout"] == "fused-qkv"
    assert optimize._attention_shapes(_llama().config)["layout"] == "per-projection"
    with pytest.raises(SchedlangError, match=r"^choose_sdpa_backend: invalid layout 'bshd': valid are "
                                             r"'heads-first', 'per-projection', 'fused-qkv'$"):
        optimize.choose_sdpa_backend(1, 2, 8, 16, layout="bshd")
    if not torch.cuda.is_available():
        assert optimize.choose_sdpa_backend(1, 2, 8, 16, layout="fused-qkv") is None  # CPU: PyTorch's default


@pytest.mark.gpu
@pytest.mark.parametrize("layout", optimize.SDPA_LAYOUTS)
def test_the_attention_probe_picks_a_backend_that_runs_on_the_gpu(layout):
    # PyTorch's default (None) unless a backend beats it by 3% of GPU time
    assert optimize.choose_sdpa_backend(2, 16, 1024, 64, layout=layout) in (None, "cudnn", "flash", "efficient")
    # a negative margin pins the fastest even where the default is as fast
    assert optimize.choose_sdpa_backend(2, 16, 1024, 64, layout=layout, margin=-1.0) in ("cudnn", "flash", "efficient")


def test_layers_with_float8_linears_compile_with_the_float8_passes():
    float8 = pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'schedlang[fp8]')")
    from schedlang.graph.passes.shared_amax import SharedAmaxPass
    from schedlang.graph.passes.shared_scaled_mm_operand import SharedScaledMMOperandPass
    from schedlang.models import _with_passes

    plain = torch.nn.Sequential(torch.nn.Linear(32, 32))
    converted = copy.deepcopy(plain)
    float8.convert_to_float8_training(converted)
    assert _with_passes(plain, {"mode": "reduce-overhead"}) == {"mode": "reduce-overhead"}
    options = _with_passes(converted, {})
    assert set(options) == {"options"} and isinstance(options["options"]["joint_custom_post_pass"], SharedAmaxPass)
    assert isinstance(options["options"]["post_grad_custom_post_pass"], SharedScaledMMOperandPass)
    # torch.compile takes a mode or options: the mode is spelled out as its options, other arguments kept
    options = _with_passes(converted, {"mode": "reduce-overhead", "fullgraph": True})
    assert options["fullgraph"] is True and "mode" not in options
    assert options["options"]["triton.cudagraphs"] is True
    assert isinstance(options["options"]["joint_custom_post_pass"], SharedAmaxPass)
    # a caller's own pass keeps its place (schedlang's other pass is still added); with its own pass in
    # every place, or a backend other than Inductor, the options are left alone
    own = {"options": {"joint_custom_post_pass": print}}
    options = _with_passes(converted, own)
    assert options["options"]["joint_custom_post_pass"] is print
    assert isinstance(options["options"]["post_grad_custom_post_pass"], SharedScaledMMOperandPass)
    own = {"options": {"joint_custom_post_pass": print, "post_grad_custom_post_pass": repr}}
    assert _with_passes(converted, own) is own
    other = {"backend": "aot_eager"}
    assert _with_passes(converted, other) is other


def test_float8_layers_share_one_compiled_graph():
    """Every layer's compile options compare equal, so torch.compile reuses the first layer's graph for
    the others instead of counting a recompile per layer (which, past its limit, runs layers eagerly)."""
    float8 = pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'schedlang[fp8]')")
    import torch._dynamo
    from torch._dynamo.utils import counters

    from schedlang.models import _with_passes, compile_layers

    torch.manual_seed(0)
    model = _llama()
    config = float8.Float8LinearConfig(emulate=True)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, name: "lm_head" not in name)
    layers = list(model.model.layers)
    cudagraphs = {"mode": "reduce-overhead"}
    assert _with_passes(layers[0], cudagraphs) == _with_passes(layers[1], cudagraphs)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=1):  # a second graph would be an error here
        assert compile_layers(model) == 2
        ids, labels = _batch(97)
        model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert all(p.grad is not None for p in layers[1].parameters())


def test_compile_layers_takes_the_built_model_not_the_schedule():
    import schedlang
    from schedlang.models import compile_layers

    sch = schedlang.create_schedule(torch.nn.Linear(2, 2))
    with pytest.raises(schedlang.ScheduleValueError, match="compile_layers: model must be the nn.Module that "
                                                           "schedlang.build returns, got Schedule"):
        compile_layers(sch)


def test_a_meta_model_built_after_optimize_is_initialized_as_the_plain_one():
    """build initializes a meta-device model's tensors with transformers' _init_weights, which recognizes an
    nn.Embedding: the fused embedding (an nn.Embedding) and the fused head are initialized as the plain modules
    they replace, so a model optimized before it exists starts from the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=88, vocab_size=97, max_position_embeddings=32, pad_token_id=3)
    built = {}
    for optimized in (False, True):
        with torch.device("meta"):
            meta = LlamaForCausalLM(cfg)
        sch = schedlang.create_schedule(meta)
        if optimized:
            optimize_model(sch, compile=None)
        torch.manual_seed(7)
        built[optimized] = schedlang.build(sch, device="cpu")[0]
    assert type(built[True].model.embed_tokens).__name__ == "FusedEmbedding"
    plain = dict(built[False].named_parameters())
    for name, p in built[True].named_parameters():
        assert torch.equal(p, plain[name]), name
    assert not built[True].model.embed_tokens.weight[3].any()  # the padding row, zeroed as nn.Embedding does

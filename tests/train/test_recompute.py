"""--activation-checkpoint selective: each LLaMA layer keeps every other matmul's output (q, v, gate, down) and
recomputes the other three (k, o, up) in the backward; gradients are those of the layer without checkpointing,
and the trainer trains the losses of a run without it."""

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from schedlang import train as trainer
from schedlang.errors import ScheduleValueError
from schedlang.train.recompute import MATMULS, checkpoint_selectively, trace_checkpoints_whole


class _CountMatmuls(TorchDispatchMode):
    # a compiled backward may run a recomputed op through run_with_rng_state(rng_state, op, *args)
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        wrapped = args[1] if isinstance(func, torch._ops.HigherOrderOperator) and len(args) > 1 else None
        if func in MATMULS or wrapped in MATMULS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _layer_and_input(seed=0):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=48, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=32)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    x = torch.randn(3, 7, 48, requires_grad=True)  # irregular batch and sequence
    position_ids = torch.arange(7).unsqueeze(0).expand(3, -1)
    rope = LlamaRotaryEmbedding(cfg)(x, position_ids)
    return layer, x, rope


def _run(mode):
    layer, x, rope = _layer_and_input()
    if mode == "selective":
        checkpoint_selectively(layer)
    elif mode == "full":
        forward = layer.forward
        layer.forward = lambda *a, **k: torch.utils.checkpoint.checkpoint(forward, *a, use_reentrant=False, **k)
    out = layer(x, position_embeddings=rope)
    out = out[0] if isinstance(out, tuple) else out
    counter = _CountMatmuls()
    with counter:
        out.square().sum().backward()
    return counter.count, x.grad, {n: p.grad for n, p in layer.named_parameters()}


def test_selective_recomputes_three_of_seven_matmuls_and_keeps_the_gradients():
    plain, selective, full = _run("none"), _run("selective"), _run("full")
    backward_matmuls = 2 * 7  # each Linear's input and weight gradients
    assert plain[0] == backward_matmuls
    assert selective[0] == backward_matmuls + 3  # k, o, up recomputed
    # full: every matmul but down, whose output no backward reads (the recomputation stops at the last saved tensor)
    assert full[0] == backward_matmuls + 6
    torch.testing.assert_close(selective[1], plain[1], rtol=1e-6, atol=1e-6)
    for name, grad in plain[2].items():
        torch.testing.assert_close(selective[2][name], grad, rtol=1e-6, atol=1e-6, msg=name)


def test_the_trainer_trains_the_same_losses_with_selective_checkpointing(tmp_path):
    flags = ["--config", "tiny", "--steps", "3", "--global-batch", "3", "--seq", "24", "--device", "cpu", "--seed",
             "4", "--lr", "3e-3"]
    losses = {}
    for mode in ("none", "selective"):
        out = tmp_path / f"{mode}.jsonl"
        extra = [] if mode == "none" else ["--activation-checkpoint", "selective"]
        assert trainer.main(flags + extra + ["--metrics", str(out)]) == 0
        losses[mode] = [json.loads(line)["loss"] for line in out.read_text().splitlines()]
    assert losses["none"][0] != losses["none"][-1]
    assert losses["selective"] == pytest.approx(losses["none"], rel=1e-5)


def test_selective_checkpointing_with_a_pipeline_is_refused(capsys):
    assert trainer.main(["--device", "cpu", "--config", "tiny", "--nproc", "2", "--pp", "2",
                         "--activation-checkpoint", "selective"]) == 2
    assert ("--activation-checkpoint selective runs on pp=1 layouts (the trainer checkpoints the whole model's "
            "layers), got --pp 2; use --activation-checkpoint full with pipelines") in capsys.readouterr().err


# -- compiled layers: the checkpoint is traced with its policy, so the compiled backward recomputes what eager does.
# "aot_eager_decomp_partition" runs the same AOTAutograd tracing and min-cut partitioner that Inductor's
# backend runs (which ops are saved is decided there), without generating C++ code on the CPU.
COMPILER = "aot_eager_decomp_partition"


def _wrap(layer, mode):
    if mode == "selective":
        checkpoint_selectively(layer)
    elif mode == "full":
        forward = layer.forward
        layer.forward = lambda *a, **k: torch.utils.checkpoint.checkpoint(forward, *a, use_reentrant=False, **k)


def _run_compiled(mode):
    torch._dynamo.reset()
    layer, x, rope = _layer_and_input()
    _wrap(layer, mode)
    layer.forward = torch.compile(layer.forward, backend=COMPILER)
    trace_checkpoints_whole(layer)
    saved = []
    # the compiled layer's forward saves its activations through autograd's hooks (no eager checkpoint is left)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x, position_embeddings=rope)
    out = out[0] if isinstance(out, tuple) else out
    counter = _CountMatmuls()
    with counter:
        out.square().sum().backward()
    # outputs of the MLP's gate and up projections and of gate * act(up) have the intermediate width (80); the
    # weights saved for the backward are 2-D with one side 80 too, but never 21 (= batch x sequence) rows
    intermediate = sum(1 for t in saved if tuple(t.shape) in ((21, 80), (3, 7, 80)))
    return counter.count, intermediate, x.grad, {n: p.grad for n, p in layer.named_parameters()}


def test_compiled_selective_saves_the_gate_and_recomputes_three_matmuls_like_eager():
    plain, selective, full = _run_compiled("none"), _run_compiled("selective"), _run_compiled("full")
    backward_matmuls = 2 * 7
    assert plain[0] == backward_matmuls
    assert selective[0] == backward_matmuls + 3  # k, o, up: the same as eager (the policy is traced)
    assert full[0] > selective[0]
    # no checkpointing keeps gate, up and their product; selective keeps the gate only; full none of them
    assert (plain[1], selective[1], full[1]) == (3, 1, 0)
    torch.testing.assert_close(selective[2], plain[2], rtol=1e-5, atol=1e-6)
    for name, grad in plain[3].items():
        torch.testing.assert_close(selective[3][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_compiled_forward_is_refused():
    torch._dynamo.reset()
    layer, _, _ = _layer_and_input()
    layer.forward = torch.compile(layer.forward, backend=COMPILER)
    with pytest.raises(ScheduleValueError) as err:
        checkpoint_selectively(layer, where="model.layers.3")
    assert str(err.value) == (
        "model.layers.3: selective checkpointing got an already compiled forward; a checkpoint around "
        "compiled code recomputes the whole layer uncompiled in the backward and saves none of the "
        "policy's outputs; checkpoint the layer first, then torch.compile it (compile_layers after "
        "checkpoint_selectively)")


# -- optimize_model's fused kernels (norms, embedding, the loss fused with the head), eager and compiled
def _optimized_model(mode, compiled):
    import schedlang
    from transformers import LlamaConfig, LlamaForCausalLM
    from schedlang.models import compile_layers, optimize_model

    torch._dynamo.reset()
    cfg = LlamaConfig(hidden_size=48, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=40, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    sch = schedlang.create_schedule(LlamaForCausalLM(cfg))
    optimize_model(sch, compile=None)  # compiled below, after the checkpoint, as the trainer does
    model, _ = schedlang.build(sch)
    for i, layer in enumerate(model.model.layers):
        if mode == "selective":
            checkpoint_selectively(layer, where=f"model.layers.{i}")
    if compiled:
        compile_layers(model, backend=COMPILER)
        for layer in model.model.layers:
            trace_checkpoints_whole(layer)
    return model


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_selective_with_optimize_model_recomputes_three_matmuls_per_layer(compiled):
    ids = torch.randint(0, 40, (2, 9))  # irregular batch and sequence
    results = {}
    for mode in ("none", "selective"):
        model = _optimized_model(mode, compiled)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        counter = _CountMatmuls()
        with counter:
            loss.backward()
        results[mode] = counter.count, loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    assert results["selective"][0] - results["none"][0] == 3 * 2  # k, o and up of each of the 2 layers
    torch.testing.assert_close(results["selective"][1], results["none"][1], rtol=1e-6, atol=1e-6)
    for name, grad in results["none"][2].items():
        torch.testing.assert_close(results["selective"][2][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_trainer_checkpoints_selectively_before_it_compiles(tmp_path, monkeypatch):
    """With --compile and --optimize (the GPU defaults) the layers are compiled after the checkpoint wraps them,
    so the compiler sees the policy, and the losses are those of the same run without checkpointing."""
    import schedlang.models
    from schedlang.models import compile_layers

    seen = []

    def compile_on_cpu(module, **options):  # Inductor's partitioner without C++ code generation (see COMPILER)
        seen.extend(getattr(layer.forward, "_torchdynamo_orig_callable", None) is None for layer in module.model.layers)
        return compile_layers(module, backend=COMPILER, **options)

    monkeypatch.setattr(schedlang.models, "compile_layers", compile_on_cpu)
    flags = ["--config", "tiny", "--steps", "2", "--global-batch", "2", "--seq", "17", "--device", "cpu", "--seed",
             "5", "--lr", "3e-3", "--optimize"]
    losses = {}
    # the reference: uncompiled and not checkpointed (optimize_model would compile it with Inductor's C++ code)
    for mode, extra in (("none", []), ("selective", ["--compile", "--activation-checkpoint", "selective"])):
        torch._dynamo.reset()
        out = tmp_path / f"{mode}.jsonl"
        assert trainer.main(flags + extra + ["--metrics", str(out)]) == 0
        losses[mode] = [json.loads(line)["loss"] for line in out.read_text().splitlines()]
    assert len(seen) == 4 and all(seen)  # the tiny preset's four layers, compiled after optimize_model, not by it
    assert losses["selective"] == pytest.approx(losses["none"], rel=1e-5)

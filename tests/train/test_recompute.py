"""--activation-checkpoint selective: each LLaMA layer keeps every other matmul's output (q, v, gate, down) and
recomputes the other three (k, o, up) in the backward; gradients are those of the layer without checkpointing,
and the trainer trains the losses of a run without it."""

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from schedlang import train as trainer
from schedlang.train.recompute import MATMULS, checkpoint_selectively


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
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

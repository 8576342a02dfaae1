"""Helpers for the tensor-parallel model tests: tiny HF configs, a reference comparison, scenario runs.

The multi-process tests spawn their ranks once per file; the worker runs every scenario and
returns ``{scenario: ("ok", value) | ("error", traceback)}``, and each test asserts on its own
entry. Everything runs on CPU ranks (gloo) here and on one GPU per rank (NCCL) when there are
enough GPUs.
"""

from __future__ import annotations

import copy
import traceback
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from torch.distributed.tensor import DTensor

from schedlang.checkpoint import full_tensor
from schedlang.distributed.collectives import all_gather_tensor
from schedlang.module_record import shard_specs

VOCAB = 128
HIDDEN = 64


def tp_mesh():
    """A one-dimensional ``tp`` mesh over the world: schedules made with it get DTensor parameters at build
    (without a mesh, sharded parameters stay plain local shards)."""
    from schedlang.distributed.mesh import make_mesh

    return make_mesh(tp=dist.get_world_size(), device_type=device().type)


def device() -> torch.device:
    # the group is "cpu:gloo,cuda:nccl" where every rank has a GPU
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def llama_config(heads: int = 4, kv_heads: int = 2, tied: bool = False, layers: int = 2):
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=HIDDEN, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    cfg._attn_implementation = "sdpa"
    return cfg


def gpt2_config(layers: int = 2):
    from transformers import GPT2Config

    cfg = GPT2Config(n_layer=layers, n_embd=HIDDEN, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    return cfg


def bert_config(layers: int = 2):
    from transformers import BertConfig

    cfg = BertConfig(num_hidden_layers=layers, hidden_size=HIDDEN, num_attention_heads=4, intermediate_size=96,
                     vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "sdpa"
    return cfg


def run_scenarios(scenarios: Dict[str, Callable[[], object]]) -> Dict[str, tuple]:
    """Run each scenario (same order on every rank); keep its value or its traceback."""
    out = {}
    for name, fn in scenarios.items():
        torch.manual_seed(0)
        try:
            out[name] = ("ok", fn())
        except Exception:  # reported to the test that owns the scenario
            out[name] = ("error", traceback.format_exc())
        if dist.is_initialized():
            dist.barrier()
    return out


def value(results: List[Dict[str, tuple]], name: str):
    """The scenario's value on every rank, or a test failure with the rank's traceback."""
    import pytest

    values = []
    for rank, per_rank in enumerate(results):
        status, v = per_rank[name]
        if status != "ok":
            pytest.fail(f"scenario {name!r} failed on rank {rank}:\n{v}")
        values.append(v)
    return values


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())


def compare(model: torch.nn.Module, reference: torch.nn.Module, kwargs: dict, logits_split: bool,
            loss_fn: Optional[Callable] = None) -> dict:
    """Run both models on ``kwargs``, backward from the loss; return max differences.

    The scheduled model's logits are gathered along the vocabulary when ``logits_split``; every
    parameter gradient is compared with the reference's gradient of the parameter of the same
    name, cut as the module's shard record says. ``loss_fn(output, full)`` computes the loss when the
    model's own loss is not used (``full``: for the reference's unsplit logits).
    """
    out = model(**kwargs)
    ref = reference(**kwargs)
    loss = loss_fn(out, full=False) if loss_fn else out.loss
    ref_loss = loss_fn(ref, full=True) if loss_fn else ref.loss
    loss.backward()
    ref_loss.backward()
    logits = all_gather_tensor(out.logits.contiguous(), -1) if logits_split else out.logits
    result = {"logits": _max_diff(logits, ref.logits), "loss": _max_diff(loss, ref_loss),
              "logits_scale": float(ref.logits.detach().abs().max()), "local_vocab": out.logits.shape[-1]}
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    largest = max((float(p.grad.abs().max()) for p in ref_params.values() if p.grad is not None), default=1.0)
    worst, worst_name, compared = 0.0, None, 0
    for mod_name, module in model.named_modules(remove_duplicate=False):
        specs = shard_specs(module)
        for pname, p in module.named_parameters(recurse=False):
            full = ref_params[f"{mod_name}.{pname}" if mod_name else pname]
            grad = p.grad
            if isinstance(grad, DTensor):
                # the DTensor's placement says where the shard belongs: compare the whole gradient
                grad, expected = full_tensor(grad), full.grad  # block-wise shards too, on any torch
            else:
                expected = specs[pname].slice_of(full.grad) if pname in specs else full.grad
            if grad is None or expected is None:
                raise AssertionError(f"{mod_name}.{pname}: gradient missing (scheduled {p.grad is not None}, "
                                     f"reference {expected is not None})")
            # relative to the gradient's own size: these gradients are far below 1 (a layer norm's weight gets
            # ~1e-3), where an absolute tolerance would pass one that is off by percents. A gradient that is zero
            # but for rounding (an attention key's bias: softmax ignores a shift of every score) is measured
            # against 1e-3 of the model's largest gradient instead.
            scale = max(float(expected.abs().max()), 1e-3 * largest) or 1.0
            d = _max_diff(grad, expected) / scale
            compared += 1
            if d > worst:
                worst, worst_name = d, f"{mod_name}.{pname}"
    result.update(grad=worst, grad_name=worst_name, grads_compared=compared)
    return result


def copies(model: torch.nn.Module):
    """(schedule-able copy, reference copy) of a model on this rank's device."""
    dev = device()
    return copy.deepcopy(model).to(dev), copy.deepcopy(model).to(dev)


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds (a DTensor's local shard)."""
    return sum(_local(p).numel() * p.element_size() for p in model.parameters())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def assert_matches(result: dict, tol: float = 2e-5) -> None:
    """Logits, loss and gradients of a :func:`compare` result within ``tol`` of the single-device model."""
    assert result["logits"] <= tol * max(1.0, result["logits_scale"]), result
    assert result["loss"] <= tol, result
    assert result["grad"] <= tol, result


def family_config(family: str, layers: int = 2):
    """A tiny config of a HF family (random weights, dropout off, SDPA attention); ``family`` names the
    entry of :data:`FAMILY_CONFIGS`."""
    import transformers

    class_name, options = FAMILY_CONFIGS[family]
    cfg = getattr(transformers, class_name)(**{**options, **_LAYERS.get(class_name, {"num_hidden_layers": layers})})
    # eager where the installed transformers has no SDPA path for the family (GPT-J before 5.2x)
    cfg._attn_implementation = "sdpa" if getattr(_model_class(family, cfg), "_supports_sdpa", True) else "eager"
    return cfg


def _model_class(family: str, cfg):
    import transformers

    head = {"bert": "BertForMaskedLM"}.get(family)
    return getattr(transformers, head) if head else transformers.AutoModelForCausalLM._model_mapping[type(cfg)]


def family_model(family: str, layers: int = 2):
    """``(model, config)``: the family's causal LM (or masked LM for BERT) with random weights."""
    import transformers

    cfg = family_config(family, layers)
    head = {"bert": "BertForMaskedLM"}.get(family)
    if head is None:
        return transformers.AutoModelForCausalLM.from_config(cfg), cfg
    return getattr(transformers, head)(cfg), cfg


_LAYERS = {"GPT2Config": {"n_layer": 2}}
_COMMON = dict(vocab_size=VOCAB, max_position_embeddings=64)
#: family -> (config class, options): hidden 64, 4 query heads (2 key/value heads where the family has GQA)
FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", dict(_COMMON, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=96)),
    "mistral": ("MistralConfig", dict(_COMMON, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(_COMMON, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=96)),
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_head=4, bos_token_id=0,
                                eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "bert": ("BertConfig", dict(_COMMON, hidden_size=HIDDEN, num_attention_heads=4, intermediate_size=96,
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "opt": ("OPTConfig", dict(_COMMON, hidden_size=HIDDEN, num_attention_heads=4, ffn_dim=96, dropout=0.0,
                              attention_dropout=0.0, word_embed_proj_dim=HIDDEN, pad_token_id=1)),
    "gpt_neox": ("GPTNeoXConfig", dict(_COMMON, hidden_size=HIDDEN, num_attention_heads=4, intermediate_size=96,
                                       attention_dropout=0.0, hidden_dropout=0.0)),
    "gemma": ("GemmaConfig", dict(_COMMON, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, intermediate_size=96)),
    "phi3": ("Phi3Config", dict(_COMMON, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4,
                                intermediate_size=96, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                attention_dropout=0.0)),
    # fewer key/value heads than query heads: the fused q|k|v projection holds parts of unequal widths
    "phi3_gqa": ("Phi3Config", dict(_COMMON, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=96, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                    attention_dropout=0.0)),
    "qwen3": ("Qwen3Config", dict(_COMMON, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, intermediate_size=96)),
    "stablelm": ("StableLmConfig", dict(_COMMON, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=96, hidden_dropout=0.0, attention_dropout=0.0)),
    "falcon": ("FalconConfig", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, multi_query=False,
                                    new_decoder_architecture=False, alibi=False, hidden_dropout=0.0,
                                    attention_dropout=0.0)),
    "gptj": ("GPTJConfig", dict(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_head=4, rotary_dim=8,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
}

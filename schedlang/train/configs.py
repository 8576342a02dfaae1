"""The models the trainer builds: HF configs (``tiny``, ``1b`` or a config.json), their dimensions
and the checks of a layout against them, and the facts the run reads off a model."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

from .flags import MODELS, _fail

logger = logging.getLogger("schedlang.train")


_TINY = {
    "llama": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=128),
    "gpt2": dict(n_embd=64, n_layer=4, n_head=4, n_inner=128, vocab_size=256, n_positions=128, bos_token_id=255,
                 eos_token_id=255),
}
#: pretraining runs without dropout (GPT-2's configs default to 0.1); layouts then compute the same thing
_NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "llama": {}}
_1B = {
    # LLaMA-1.1B (TinyLlama's depth and width, with full multi-head attention)
    "llama": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=16, num_key_value_heads=16,
                  intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5),
    # GPT-2 has no 1B size whose heads split over 2, 4 and 8 ranks: GPT-2 medium (355M), vocabulary padded
    # from 50257 to 50304 so that it divides by the tensor-parallel sizes
    "gpt2": dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50304, n_positions=1024),
}


def _config_class(model: str):
    if model == "llama":
        from transformers import LlamaConfig

        return LlamaConfig
    from transformers import GPT2Config

    return GPT2Config


def model_config(model: str, config: str):
    """The HF config of ``--model`` / ``--config`` (``tiny``, ``1b`` or a config.json path or its directory)."""
    if model not in MODELS:
        _fail(f"--model: unknown model {model!r}: valid models are {', '.join(MODELS)}")
    klass = _config_class(model)
    if config in ("tiny", "1b"):
        cfg = klass(**(_TINY if config == "tiny" else _1B)[model], **_NO_DROPOUT[model])
        if config == "1b" and model == "gpt2":
            logger.info("--model gpt2 --config 1b is GPT-2 medium (355M parameters)")
    else:
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            _fail(f"--config {config!r} is neither 'tiny', '1b' nor an existing HF config.json (or its directory)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            _fail(f"--config {config}: cannot read a JSON config ({e}); pass a transformers "
                  "config.json")
        if not isinstance(raw, dict):
            _fail(f"--config {config}: holds a JSON {type(raw).__name__}, not an object; pass a transformers "
                  "config.json ({\"hidden_size\": ..., ...})")
        kind = raw.get("model_type")
        if kind is not None and kind != klass.model_type:
            _fail(f"--config {config} describes a {kind!r} model but --model is {model!r} (model_type "
                  f"{klass.model_type!r}); pass a --config of a {model!r} model, or set --model {kind}")
        try:
            cfg = klass.from_dict(raw)
        except Exception as e:  # transformers' own validation (e.g. heads that do not divide the hidden size)
            reason = " ".join(line.strip() for line in str(e).splitlines() if line.strip()).rstrip(".")
            _fail(f"--config {config}: transformers refuses it as a {klass.__name__}: {reason}; fix the config")
        unknown = _unknown_keys(klass, raw, cfg)
        if unknown:
            _fail(f"--config {config}: unknown key(s) {', '.join(unknown)} for a {klass.__name__}: valid keys are "
                  f"{', '.join(sorted(_own_keys(klass)))}")
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    return cfg


#: keys of published config.json files that transformers no longer reads but still carries (the generic
#: settings of transformers 4's PretrainedConfig, GPT-2's n_ctx): not typos, so not refused
_LEGACY_KEYS = frozenset({
    "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "is_decoder", "cross_attention_hidden_size",
    "add_cross_attention", "tie_encoder_decoder", "finetuning_task", "num_labels", "tokenizer_class", "prefix",
    "sep_token_id", "decoder_start_token_id", "task_specific_params", "gradient_checkpointing", "_commit_hash",
    "_attn_implementation", "n_ctx",
})


def _own_keys(klass) -> set:
    """The keys a config class reads: its fields, with their defaults, and its aliases (``n_embd`` ...)."""
    return set(klass().to_dict()) | set(getattr(klass, "attribute_map", {}))


def _unknown_keys(klass, raw: Dict, cfg) -> List[str]:
    """Keys of ``raw`` that the config class does not read. transformers keeps any key as an attribute, so a
    misspelt or foreign key would silently leave its setting at the default (``{"foo": 1}`` builds a default,
    7B LLaMA)."""
    from transformers import GenerationConfig

    known = _own_keys(klass) | set(GenerationConfig().to_dict()) | _LEGACY_KEYS
    loaded = cfg.to_dict()
    # a key transformers converts when loading (rope_theta -> rope_parameters, torch_dtype -> dtype) is gone
    # from the loaded config: it reads it
    return sorted(k for k in raw if k not in known and k in loaded)


@dataclass
class Dims:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    positions: int


def model_dims(model: str, cfg) -> Dims:
    if model == "llama":
        return Dims(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                    cfg.num_key_value_heads or cfg.num_attention_heads, cfg.intermediate_size, cfg.vocab_size,
                    cfg.max_position_embeddings)
    return Dims(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head, cfg.n_inner or 4 * cfg.n_embd, cfg.vocab_size,
                cfg.n_positions)


def validate_model(ns, dims: Dims) -> None:
    # transformers checks a LLaMA config's heads itself; GPT-2's config takes any, and its attention would fail
    if dims.heads < 1 or dims.hidden % dims.heads:
        _fail(f"--config {ns.config}: the hidden size {dims.hidden} must be divisible by the number of attention "
              f"heads ({dims.heads}, at least 1)")
    if ns.seq > dims.positions:
        _fail(f"--seq {ns.seq} exceeds the model's {dims.positions} positions; use --seq <= {dims.positions}")
    tp = ns.tp
    split = (("attention heads", dims.heads), ("key/value heads", dims.kv_heads),
             ("MLP intermediate size", dims.intermediate), ("vocabulary size", dims.vocab))
    for what, n in split:
        if n % tp:
            valid = [d for d in range(1, min(m for _, m in split) + 1) if all(m % d == 0 for _, m in split)]
            _fail(f"--tp {tp} must divide the model's {what} ({n}); valid --tp values for this model: "
                  f"{', '.join(map(str, valid))}")
    if ns.sp and ns.seq % tp:
        _fail(f"--sp splits the sequence over --tp {tp} ranks: --seq {ns.seq} must be divisible by {tp}")
    stages = ns.pp * ns.stages_per_rank
    if stages > 1 and dims.layers < stages:
        _fail(f"--pp {ns.pp} x --stages-per-rank {ns.stages_per_rank} = {stages} pipeline stages but the model has "
              f"only {dims.layers} layers")


def _model_class(model: str):
    if model == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel


def _tied_names(model) -> Dict[str, str]:
    """``{name: first name}`` for every name of a parameter the model holds under several names (tied weights)."""
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n: group[0] for group in names.values() if len(group) > 1 for n in group}


def _layers_path(model: str) -> str:
    return "model.layers" if model == "llama" else "transformer.h"


def _flops_params(model) -> int:
    """Parameters that cost 6 flops per token in a train step: all but the input (and position) embeddings; a
    tied embedding counts once, as the output head."""
    total = sum(p.numel() for p in model.parameters())
    inp = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight is not inp:
        total -= inp.numel()
    for name, p in model.named_parameters():
        if name.endswith("wpe.weight"):
            total -= p.numel()
    return total


def _stage_cuts(layers: int, stages: int) -> List[int]:
    """Indices of the layers after which a stage ends: ``stages`` near-equal runs of layers."""
    bounds = [round(layers * (i + 1) / stages) for i in range(stages - 1)]
    return [b - 1 for b in bounds]

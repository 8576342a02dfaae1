"""The models the trainer builds: HF configs of any causal-LM family (the presets ``tiny`` and ``1b``
of LLaMA and GPT-2, or a config.json whose ``model_type`` picks the family through transformers'
auto classes), their dimensions, and the checks of a layout against them."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from .flags import _fail

logger = logging.getLogger("schedlang.train")

#: families with the presets ``tiny`` and ``1b``; any other family comes from a config.json
PRESET_FAMILIES = ("llama", "gpt2")
PRESETS = ("tiny", "1b", "8b", "70b", "405b")
#: LLaMA-3 sizes from Meta's published HF config.json files (Meta-Llama-3-8B, Meta-Llama-3-70B,
#: Llama-3.1-405B): for planning with --dry-run (the weights would not fit a test machine)
_LLAMA3 = dict(num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
               tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
_LARGE = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=14336,
               max_position_embeddings=8192, **_LLAMA3),
    "70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, intermediate_size=28672,
                max_position_embeddings=8192, **_LLAMA3),
    "405b": dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128, intermediate_size=53248,
                 max_position_embeddings=131072, **_LLAMA3),
}

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


def _config_class(model_type: str, where: str):
    """The transformers config class of ``model_type`` (AutoConfig's registry)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        import transformers

        _fail(f"{where}: model_type {model_type!r} is not a model family this transformers ({transformers.__version__}) "
              "knows; pass the config.json of a HF causal language model (e.g. llama, qwen3, mistral, gemma, phi3, "
              "opt, gpt2)")


def causal_lm_families() -> List[str]:
    """The model types transformers' ``AutoModelForCausalLM`` builds."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _check_causal_lm(model_type: str, where: str) -> None:
    if model_type not in causal_lm_families():
        _fail(f"{where}: {model_type!r} models have no causal-LM class in transformers (AutoModelForCausalLM), and "
              "schedlang train trains causal language models; pass the config of a decoder (e.g. llama, qwen3, "
              "mistral, gemma, phi3, opt, gpt2)")


def model_config(model: Optional[str], config: str):
    """The HF config of ``--model`` / ``--config``: a preset (``tiny`` / ``1b`` of ``llama`` or ``gpt2``) or a
    config.json path (or its directory), whose ``model_type`` picks the family."""
    if config in _LARGE:
        model = model or "llama"
        if model != "llama":
            _fail(f"--model {model}: the presets {', '.join(_LARGE)} are LLaMA-3 sizes; use --model llama (or drop "
                  f"--model), or give --config the path of a {model!r} config.json")
        cfg = _config_class("llama", "--model")(**_LARGE[config])
    elif config in PRESETS:
        model = model or "llama"
        if model not in PRESET_FAMILIES:
            _fail(f"--model {model}: the presets 'tiny' and '1b' exist for {', '.join(PRESET_FAMILIES)}; for a "
                  f"{model!r} model give --config the path of its config.json (or its directory)")
        klass = _config_class(model, "--model")
        cfg = klass(**(_TINY if config == "tiny" else _1B)[model], **_NO_DROPOUT[model])
        if config == "1b" and model == "gpt2":
            logger.info("--model gpt2 --config 1b is GPT-2 medium (355M parameters)")
    else:
        raw = read_config_json(config)
        kind = raw.get("model_type") or model
        if kind is None:
            _fail(f"--config {config}: the config has no 'model_type'; add it (e.g. \"model_type\": \"llama\") or "
                  "name the family with --model")
        if model is not None and kind != model:
            _fail(f"--config {config} describes a {kind!r} model but --model is {model!r} (model_type "
                  f"{model!r}); pass a --config of a {model!r} model, or set --model {kind}")
        klass = _config_class(kind, f"--config {config}")
        _check_causal_lm(kind, f"--config {config}")
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


def read_config_json(config: str) -> Dict:
    """The JSON object of ``--config`` (a config.json or its directory)."""
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        _fail(f"--config {config!r} is neither 'tiny', '1b' nor an existing HF config.json (or its directory)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        _fail(f"--config {config}: cannot read a JSON config ({e}); pass a transformers config.json")
    if not isinstance(raw, dict):
        _fail(f"--config {config}: holds a JSON {type(raw).__name__}, not an object; pass a transformers "
              "config.json ({\"hidden_size\": ..., ...})")
    return raw


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


def _first(cfg, *names):
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def model_dims(model_or_cfg, cfg=None) -> Dims:
    """The dimensions of a HF causal-LM config, whatever its family calls them (``model_dims(cfg)``; the
    older ``model_dims(family, cfg)`` still works)."""
    cfg = model_or_cfg if cfg is None else cfg
    heads = _first(cfg, "num_attention_heads", "n_head")
    kv = _first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv is None:
        kv = 1 if getattr(cfg, "multi_query", False) else heads
    hidden = _first(cfg, "hidden_size", "n_embd")
    return Dims(layers=_first(cfg, "num_hidden_layers", "n_layer"), hidden=hidden, heads=heads, kv_heads=kv,
                intermediate=_first(cfg, "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size") or 4 * hidden,
                vocab=cfg.vocab_size,
                positions=_first(cfg, "max_position_embeddings", "n_positions", "seq_length") or 2**31 - 1)


def head_dim(cfg, dims: Dims) -> int:
    return _first(cfg, "head_dim") or dims.hidden // max(1, dims.heads)


def validate_model(ns, dims: Dims, cfg=None) -> None:
    """The layout of ``ns`` against the model: raises :class:`TrainError` before any weight is allocated."""
    explicit_head_dim = cfg is not None and _first(cfg, "head_dim") is not None
    if dims.heads is None or dims.heads < 1 or (not explicit_head_dim and dims.hidden % dims.heads):
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
            if what == "key/value heads" and n < tp:
                _fail(f"--tp {tp}: the model has {n} key/value head(s), fewer than the {tp} tensor-parallel ranks; "
                      f"each rank needs whole key/value heads (they are not replicated); valid --tp values for this "
                      f"model: {', '.join(map(str, valid))}")
            _fail(f"--tp {tp} must divide the model's {what} ({n}); valid --tp values for this model: "
                  f"{', '.join(map(str, valid))}")
    if getattr(ns, "float8", False):
        from ..primitives.float8 import ALIGNMENT, DEFAULT_MIN_FEATURES

        sizes = {"hidden size": dims.hidden, "MLP intermediate size per tp rank": dims.intermediate // tp}
        bad = {k: v for k, v in sizes.items() if v < DEFAULT_MIN_FEATURES or v % ALIGNMENT}
        if bad:
            _fail(f"--float8 trains the layers' Linears in float8, whose GEMMs need both sides a multiple of "
                  f"{ALIGNMENT} and at least {DEFAULT_MIN_FEATURES} (smaller ones cost more in casts than they "
                  f"save): this model's {', '.join(f'{k} is {v}' for k, v in bad.items())}; drop --float8")
    if ns.sp and ns.seq % tp:
        _fail(f"--sp splits the sequence over --tp {tp} ranks: --seq {ns.seq} must be divisible by {tp}")
    stages = ns.pp * ns.stages_per_rank
    if stages > 1 and dims.layers < stages:
        _fail(f"--pp {ns.pp} x --stages-per-rank {ns.stages_per_rank} = {stages} pipeline stages but the model has "
              f"only {dims.layers} layers")


def valid_tp_sizes(dims: Dims, limit: int) -> List[int]:
    """Tensor-parallel sizes up to ``limit`` that split the model's heads, kv heads, MLP and vocabulary."""
    return [t for t in range(1, limit + 1)
            if all(n % t == 0 for n in (dims.heads, dims.kv_heads, dims.intermediate, dims.vocab))]


def _model_class(model_or_cfg):
    """The causal-LM class of a family name (``"llama"``) or a config."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = model_or_cfg if isinstance(model_or_cfg, str) else model_or_cfg.model_type
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind])


def build_meta_model(cfg):
    """The model of ``cfg`` on the meta device (no memory for weights), through ``AutoModelForCausalLM``."""
    import schedlang
    from transformers import AutoModelForCausalLM

    with schedlang.init_empty_weights():
        try:
            return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        except (ValueError, ImportError) as e:  # a family without SDPA attention: its eager attention
            logger.info("%s has no SDPA attention (%s): using its eager attention", cfg.model_type, e)
            cfg._attn_implementation = "eager"
            return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")

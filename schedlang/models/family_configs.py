"""Tiny configs of every causal-LM family transformers ships, for sweeping schedules over them.

transformers lists its causal LMs in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (model type -> class).
:func:`tiny_config` builds one family's config from its config class with small sizes: hidden 64,
4 query and 2 key/value heads of 16, 2 layers, a vocabulary of 128, 4 experts (2 per token),
dropout off, no cache. The sizes are set generically, under each name the config class takes
(its own spelling through ``attribute_map``: GPT-2's ``n_embd`` for ``hidden_size``), so a new
family usually needs nothing; :data:`OVERRIDES` holds the few per-family corrections.

Lists with one entry per layer (``layer_types``, ``mlp_layer_types`` ...) are cut down to a layer of
each kind the family has, in order, so a hybrid family keeps its attention and its other layers.

A family that cannot be checked this way raises :class:`FamilySkipped` saying why: an
encoder-decoder model (its causal LM is the decoder half, with cross-attention), a multimodal
model (a text entry covers its decoder where transformers has one), a package it needs is
missing, or its config cannot be shrunk generically (the model would still hold millions of
parameters).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["FamilySkipped", "Family", "causal_lm_families", "tiny_config", "tiny_model", "meta_model", "VOCAB",
           "HIDDEN", "MAX_PARAMETERS", "OVERRIDES"]

VOCAB = 128
HIDDEN = 64
#: a tiny model holds well under a million parameters; one over this was not shrunk (a size the generic
#: names do not reach) and would make the sweep slow and memory-hungry
MAX_PARAMETERS = 2_000_000

#: generic small sizes, by transformers' standard names (a config class's attribute_map gives its own)
SMALL: Dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=96, max_position_embeddings=64, ffn_dim=96, n_inner=96, ffn_hidden_size=96,
    embedding_size=HIDDEN, d_model=HIDDEN, kv_channels=16,
    # mixture of experts
    num_local_experts=4, num_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_topk=2,
    top_k_experts=2, moe_k=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    shared_intermediate_size=32, shared_experts_intermediate_size=32, n_group=1, topk_group=1,
    # multi-head latent attention (DeepSeek-V2/V3)
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    index_head_dim=16, index_n_heads=2, index_topk=8,
    # state-space and linear-attention layers
    mamba_d_state=8, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_chunk_size=16, mamba_expand=2,
    mamba_d_ssm=128, state_size=8, time_step_rank=8, chunk_size=16, n_groups=1, mamba_dt_rank=8,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_head_dim=16, linear_num_heads=4,
    # others
    rotary_dim=8, num_kv_heads=2, sliding_window=16, intermediate_size_mlp=96, swa_num_attention_heads=4,
    swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=16, embedding_multiplier=1.0,
    use_cache=False, first_k_dense_replace=1, num_dense_layers=1, moe_layer_start_index=1,
)

#: token ids a config may hold; kept inside the small vocabulary
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
             "forced_eos_token_id", "eod_token_id")

#: per-family corrections of :data:`SMALL` (config arguments), each with the reason in a comment
OVERRIDES: Dict[str, Dict[str, Any]] = {
    # GPT-Neo lists its attention kinds as [[kinds], repeats]: one global and one local layer
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_layers=2, window_size=16),
    # Falcon's default is the 7B layout (multi-query, parallel attention); this is the classic one
    "falcon": dict(new_decoder_architecture=False, multi_query=False, alibi=False, num_kv_heads=4),
}


class FamilySkipped(Exception):
    """A family cannot be checked from a tiny config; ``str()`` says why (not an error of schedlang's)."""


@dataclasses.dataclass(frozen=True)
class Family:
    """One entry of transformers' causal-LM mapping."""

    model_type: str
    class_name: str

    def model_class(self) -> type:
        import transformers

        klass = getattr(transformers, self.class_name, None)
        if klass is None:
            raise FamilySkipped(f"transformers has no class {self.class_name}")
        return klass


def causal_lm_families() -> List[Family]:
    """Every entry of transformers' causal-LM mapping, sorted by model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [Family(t, c) for t, c in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())]


def _config_class(model_type: str) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except (KeyError, ImportError) as e:
        raise FamilySkipped(f"no config class for {model_type!r} ({type(e).__name__}: {e})") from None


def _parameters(klass: type) -> Dict[str, inspect.Parameter]:
    return dict(inspect.signature(klass.__init__).parameters)


def _per_layer_lists(defaults, layers: int) -> Dict[str, list]:
    """Attributes of the default config holding one entry per layer, as lists."""
    found = {}
    for name, value in vars(defaults).items():
        if isinstance(value, (list, tuple)) and len(value) == layers and layers > 2 and not name.endswith("_id"):
            found[name] = list(value)
    return found


def _kept_layers(per_layer: Dict[str, list], layers: int) -> List[int]:
    """Indices of the layers to keep: the first of each kind (the tuple of every per-layer list), at least two."""
    kept, kinds = [], set()
    for i in range(layers):
        kind = tuple(repr(v[i]) for v in per_layer.values())
        if kind not in kinds:
            kinds.add(kind)
            kept.append(i)
    for i in range(layers):
        if len(kept) >= 2:
            break
        if i not in kept:
            kept.append(i)
    return sorted(kept)


def _generic_arguments(model_type: str, klass: type) -> Dict[str, Any]:
    params = _parameters(klass)
    names = dict(getattr(klass, "attribute_map", {}) or {})
    arguments: Dict[str, Any] = {}
    for name, value in SMALL.items():
        own = names.get(name, name)
        if own in params:
            arguments[own] = value
    for name, p in params.items():
        default = p.default
        if ("dropout" in name or "pdrop" in name or name.endswith("drop_prob")) and \
                isinstance(default, float) and not isinstance(default, bool):
            arguments[name] = 0.0
        if name.endswith("layerdrop") and isinstance(default, float):
            arguments[name] = 0.0
    try:
        defaults = klass()
    except Exception:  # a config that needs arguments: no per-layer lists to cut
        defaults = None
    if defaults is not None:
        for name in TOKEN_IDS:
            value = getattr(defaults, name, None) if name in params else None
            if isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
                arguments[name] = VOCAB - 1
            elif isinstance(value, (list, tuple)) and any(isinstance(v, int) and v >= VOCAB for v in value):
                arguments[name] = [min(int(v), VOCAB - 1) for v in value]
        layers_name = names.get("num_hidden_layers", "num_hidden_layers")
        layers = getattr(defaults, layers_name, None)
        if isinstance(layers, int) and layers_name in params:
            per_layer = {n: v for n, v in _per_layer_lists(defaults, layers).items() if n in params}
            if per_layer:
                kept = _kept_layers(per_layer, layers)
                arguments[layers_name] = len(kept)
                for n, values in per_layer.items():
                    arguments[n] = [values[i] for i in kept]
    arguments.update(OVERRIDES.get(model_type, {}))
    return arguments


def tiny_config(model_type: str):
    """A tiny config of ``model_type`` (see the module docstring); :class:`FamilySkipped` if there is none.

    Example::

        cfg = tiny_config("mixtral")      # 2 layers, hidden 64, 4 experts
    """
    klass = _config_class(model_type)
    params = _parameters(klass)
    if any(n in params for n in ("vision_config", "audio_config", "vq_config", "text_encoder", "audio_encoder")):
        raise FamilySkipped("multimodal: an image or audio encoder beside the decoder, not a decoder-only model")
    if "text_config" in params or "decoder_config" in params:
        raise FamilySkipped("composite config (the decoder's config nested inside), not a decoder-only model")
    try:
        encoder_decoder = bool(klass().is_encoder_decoder)
    except Exception:  # a config that needs arguments tells below
        encoder_decoder = False
    if encoder_decoder or "encoder_layers" in params:
        raise FamilySkipped("encoder-decoder: its causal LM is the decoder half, with cross-attention")
    try:
        config = klass(**_generic_arguments(model_type, klass))
    except Exception as e:  # the family's own validation refused the small sizes
        raise FamilySkipped(f"its config refuses the generic small sizes ({type(e).__name__}: "
                            f"{_first_line(e)})") from None
    if getattr(config, "is_encoder_decoder", False):
        raise FamilySkipped("encoder-decoder: its causal LM is the decoder half, with cross-attention")
    if hasattr(config, "is_decoder"):
        config.is_decoder = True  # an encoder family used as a decoder: causal attention
    config._attn_implementation = "sdpa"
    return config


def _first_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 160 else text[:157] + "..."


def meta_model(family: Family) -> Tuple[nn.Module, Any]:
    """``(model, config)``: the family's tiny causal LM on the meta device (no memory), or FamilySkipped."""
    config = tiny_config(family.model_type)
    klass = family.model_class()
    if not getattr(klass, "_supports_sdpa", True):
        config._attn_implementation = "eager"
    try:
        with torch.device("meta"):
            model = klass(config)
    except ImportError as e:
        raise FamilySkipped(f"needs a package that is not installed ({_first_line(e)})") from None
    except Exception as e:  # the family's own code refused the small config
        raise FamilySkipped(f"cannot be built from a small config ({type(e).__name__}: {_first_line(e)})") from None
    size = sum(p.numel() for p in model.parameters())
    if size > MAX_PARAMETERS:
        raise FamilySkipped(f"not shrunk by the generic sizes: {size:,} parameters (a size under a name of its "
                            f"own stays large)")
    return model, config


def tiny_model(family: Family, seed: int = 0) -> Tuple[nn.Module, Any]:
    """``(model, config)``: the family's tiny causal LM with random weights (seeded), or FamilySkipped."""
    meta_model(family)  # refuses what would be too large before allocating it
    config = tiny_config(family.model_type)
    klass = family.model_class()
    if not getattr(klass, "_supports_sdpa", True):
        config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return klass(config), config


def example_ids(config, batch: int = 2, seq: int = 12, seed: int = 0, device: Optional[torch.device] = None):
    """Token ids for a tiny model: inside its vocabulary, away from the special ids at its ends."""
    generator = torch.Generator().manual_seed(seed)
    high = min(int(getattr(config, "vocab_size", VOCAB) or VOCAB), VOCAB) - 1
    return torch.randint(2, high, (batch, seq), generator=generator).to(device or "cpu")

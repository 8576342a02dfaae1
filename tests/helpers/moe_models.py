"""Tiny mixture-of-experts models of four transformers families for the expert-parallel tests, and the
per-rank batches (irregular: each rank its own batch size and length)."""

from __future__ import annotations

from typing import List

import torch

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3")
VOCAB = 64


def tiny_config(family: str, experts: int = 8):
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(**common, moe_intermediate_size=16, intermediate_size=48, num_experts=experts,
                                num_experts_per_tok=2, head_dim=8, output_router_logits=True, norm_topk_prob=True)
    if family == "mixtral":
        return T.MixtralConfig(**common, intermediate_size=16, num_local_experts=experts // 2, num_experts_per_tok=2,
                               head_dim=8, output_router_logits=True)
    if family == "olmoe":
        return T.OlmoeConfig(**common, intermediate_size=16, num_experts=experts, num_experts_per_tok=2,
                             output_router_logits=True)
    if family == "deepseek_v3":  # shared experts, grouped routing, the first layer dense
        return T.DeepseekV3Config(**common, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=experts,
                                  num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                                  first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=8)
    raise ValueError(family)


def tiny_model(family: str, experts: int = 8, seed: int = 0):
    import transformers as T

    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(tiny_config(family, experts))
    # transformers initialises the router of some families to zeros; random routers route unevenly, so some
    # experts get no token on some rank
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0.0, 0.5)
    return model


def rank_batches(world: int) -> List[torch.Tensor]:
    """Rank r's token ids: batch 1 or 2, length 5 + 3r (every rank a different token count)."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, VOCAB, (1 + r % 2, 5 + 3 * r), generator=g) for r in range(world)]

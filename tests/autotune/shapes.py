"""Model shapes the planner's tests share: LLaMA-3 8B / 70B / 405B as their published HF configs build them
(parameter counts as transformers' LlamaForCausalLM has them, untied output head)."""

from schedlang.autotune.moe_cost import MoEShape
from schedlang.autotune.training_cost import ModelShape


def llama3(layers: int, hidden: int, heads: int, intermediate: int) -> ModelShape:
    vocab, kv_heads, head_dim = 128256, 8, hidden // heads
    per_layer = (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
                 + 3 * hidden * intermediate + 2 * hidden)  # gate, up, down; two norms
    params = layers * per_layer + 2 * vocab * hidden + hidden  # embedding, head, final norm
    return ModelShape(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      intermediate=intermediate, vocab=vocab, params=params, flops_params=params - vocab * hidden,
                      embedding_params=2 * vocab * hidden)


LLAMA3_8B = llama3(32, 4096, 32, 14336)
LLAMA3_70B = llama3(80, 8192, 64, 28672)
LLAMA3_405B = llama3(126, 16384, 128, 53248)


def qwen3_moe(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, experts: int, top_k: int,
              expert_intermediate: int, vocab: int) -> ModelShape:
    """A Qwen3-MoE model as transformers builds it: every layer's MLP routed to ``top_k`` of ``experts`` gated
    experts, q/k norms, an untied head."""
    expert_params = layers * experts * 3 * hidden * expert_intermediate
    dense_layer = (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
                   + 2 * head_dim + 2 * hidden + experts * hidden)  # q/k norms, two norms, the router
    params = layers * dense_layer + expert_params + 2 * vocab * hidden + hidden
    moe = MoEShape(experts=experts, top_k=top_k, expert_intermediate=expert_intermediate, moe_layers=layers,
                   expert_params=expert_params)
    return ModelShape(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      intermediate=expert_intermediate, vocab=vocab, params=params,
                      flops_params=params - vocab * hidden - expert_params + int(moe.active_expert_params),
                      embedding_params=2 * vocab * hidden, moe=moe)


QWEN3_30B_A3B = qwen3_moe(48, 2048, 32, 4, 128, 128, 8, 768, 151936)

"""Tiny HuggingFace causal language models built from configs (random weights, nothing downloaded),
shared by the tests of the trainer, checkpoints, pretrained weights, pipelines and the report.

Each test states only what it needs to differ from these defaults::

    model = llama(seed=0, num_hidden_layers=4)          # LlamaForCausalLM, hidden 64, vocabulary 256
    config = gpt2_config(n_embd=32, vocab_size=64)      # GPT2Config without dropout
"""

from typing import List, Optional

import torch

#: hidden 64, 2 layers, 4 heads and 4 key/value heads, MLP 128, vocabulary 256, 128 positions
LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=128, vocab_size=256, max_position_embeddings=128)
#: the same sizes for GPT-2 (its MLP is 4 x hidden unless n_inner says otherwise)
GPT2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0, eos_token_id=0)


def _attention(cfg, attn: Optional[str]):
    if attn is not None:
        cfg._attn_implementation = attn
    return cfg


def llama_config(attn: Optional[str] = "sdpa", **overrides):
    """A tiny ``LlamaConfig`` (:data:`LLAMA` updated by ``overrides``); ``attn=None`` leaves the
    attention implementation to transformers."""
    from transformers import LlamaConfig

    return _attention(LlamaConfig(**{**LLAMA, **overrides}), attn)


def gpt2_config(attn: Optional[str] = "sdpa", dropout: float = 0.0, **overrides):
    """A tiny ``GPT2Config`` (:data:`GPT2` updated by ``overrides``), with ``dropout`` for the
    residual, embedding and attention dropouts (GPT-2's own default is 0.1)."""
    from transformers import GPT2Config

    drops = dict(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return _attention(GPT2Config(**{**GPT2, **drops, **overrides}), attn)


def llama(seed: int = 0, **config):
    """``LlamaForCausalLM`` of :func:`llama_config` (``config``), weights drawn after ``manual_seed(seed)``."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(**config)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def gpt2(seed: int = 0, **config):
    """``GPT2LMHeadModel`` of :func:`gpt2_config` (``config``), weights drawn after ``manual_seed(seed)``."""
    from transformers import GPT2LMHeadModel

    cfg = gpt2_config(**config)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def token_batches(n: int, batch: int, seq: int, vocab: int, seed: int) -> List[torch.Tensor]:
    """``n`` batches of ``(batch, seq + 1)`` random token ids (inputs ``[:, :-1]``, labels ``[:, 1:]``)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(n)]

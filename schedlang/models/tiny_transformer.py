"""A small GPT-style transformer that ships with schedlang, for the demo and the tutorials.

Written as ordinary PyTorch (no schedlang inside), like any model a user brings. Its
attention derives the number of heads from the projection's output size, so a
tensor-parallel schedule that shards q/k/v by heads needs no attribute fix-ups.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyConfig", "TinyTransformer", "tensor_parallel_schedule"]


@dataclasses.dataclass
class TinyConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    num_heads: int = 4
    intermediate_size: int = 512
    num_layers: int = 4
    max_positions: int = 256
    dropout: float = 0.1


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t):
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyTransformer(nn.Module):
    """Decoder-only language model: token + position embeddings, pre-norm blocks, a linear head."""

    def __init__(self, cfg: TinyConfig = None):
        super().__init__()
        cfg = cfg or TinyConfig()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tensor_parallel_schedule(sch, checkpoint: bool = False) -> None:
    """Megatron-style tensor parallelism for every block of a :class:`TinyTransformer` schedule.

    Attention: q/k/v column-parallel (each rank owns ``num_heads / world`` heads), the output
    projection row-parallel; MLP: fc1 column-parallel, fc2 row-parallel. One all-reduce in
    forward after each row-parallel layer, one in backward at each column-parallel input.
    """
    for i in range(len(sch["blocks"].child)):
        block = sch[f"blocks.{i}"]
        for name in ("q_proj", "k_proj", "v_proj"):
            block[f"attn.{name}"].shard("weight", axis=0)
            block[f"attn.{name}"].shard("bias", axis=0)
        block["attn"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        block["attn.out_proj"].shard("weight", axis=1)
        block["attn.out_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        block["mlp.fc1"].shard("weight", axis=0)
        block["mlp.fc1"].shard("bias", axis=0)
        block["mlp.fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        block["mlp.fc2"].shard("weight", axis=1)
        block["mlp.fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        if checkpoint:
            block.checkpoint()

"""Which ``torch.nn`` module computes each functional op (``F.gelu`` -> ``nn.GELU``)."""

from typing import Callable, Dict

import torch.nn.functional as F
from torch import nn

__all__ = ["MAPPING_FROM_FUNCTIONAL_TO_MODULE"]

MAPPING_FROM_FUNCTIONAL_TO_MODULE: Dict[Callable, type] = {
    F.linear: nn.Linear, F.embedding: nn.Embedding, F.layer_norm: nn.LayerNorm, F.group_norm: nn.GroupNorm,
    F.dropout: nn.Dropout, F.relu: nn.ReLU, F.gelu: nn.GELU, F.silu: nn.SiLU, F.conv1d: nn.Conv1d,
    F.conv2d: nn.Conv2d, F.mse_loss: nn.MSELoss, F.cross_entropy: nn.CrossEntropyLoss,
}

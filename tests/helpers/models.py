"""Small models shared by the tests."""

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden=12, inner=20, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner, bias=bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, hidden=12, inner=20):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, inner)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.mlp(self.norm(x)))


class Stack(nn.Module):
    def __init__(self, hidden=12, inner=20, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden, inner) for _ in range(layers))
        self.head = nn.Linear(hidden, 5)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def state_snapshot(module: nn.Module):
    """Everything that must not change on the user's model: tensors (by value and identity), hooks, children."""
    return {
        "tensors": {n: (id(t), t.detach().clone()) for n, t in
                    list(module.named_parameters()) + list(module.named_buffers())},
        "modules": [(n, id(m), type(m), len(m._forward_hooks), len(m._forward_pre_hooks),
                     len(m._backward_hooks), "forward" in m.__dict__) for n, m in module.named_modules()],
    }


def assert_unchanged(module: nn.Module, snapshot) -> None:
    now = state_snapshot(module)
    assert now["modules"] == snapshot["modules"]
    assert now["tensors"].keys() == snapshot["tensors"].keys()
    for name, (ident, value) in snapshot["tensors"].items():
        assert now["tensors"][name][0] == ident, name
        torch.testing.assert_close(now["tensors"][name][1], value, rtol=0, atol=0)

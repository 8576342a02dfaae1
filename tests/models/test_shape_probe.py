"""schedlang.models.shape_probe: one forward on fake tensors says whether a (split) model still fits together."""

from torch import nn

from schedlang.models.shape_probe import probe_forward
from tests.models import tp_checks as T


def test_a_model_that_runs_gives_no_failure():
    model, _ = T.family_model("llama")
    assert probe_forward(model) is None


class _Heads(nn.Module):
    def __init__(self, hidden=16, heads=4):
        super().__init__()
        self.proj, self.heads = nn.Linear(hidden, hidden), heads

    def forward(self, x):
        return self.proj(x).view(*x.shape[:2], self.heads, -1)


class _ToyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.block = nn.Embedding(32, 16), _Heads()

    def forward(self, input_ids):
        return self.block(self.embed(input_ids))


def test_a_forward_that_breaks_names_the_innermost_module_and_the_error():
    model = _ToyLM()
    assert probe_forward(model) is None
    model.block.proj = nn.Linear(16, 6)  # as if split over ranks while the head count stayed whole
    failure = probe_forward(model)
    assert failure is not None and failure.path == "block" and failure.module_type == "_Heads"
    assert failure.error.startswith("RuntimeError: shape '[2, 8, 4, -1]' is invalid"), failure.error
    assert all(p.device.type == "cpu" and not p.is_meta for p in model.parameters())  # nothing left fake

import torch
import torch.nn.functional as F
from torch import nn

from .models import check_fusion, count_calls, randomize


class Heads(nn.Module):
    """Three projections of one input with different widths, as modules and as F.linear."""

    def __init__(self, bias=True):
        super().__init__()
        self.q = nn.Linear(7, 3, bias=bias)
        self.k = nn.Linear(7, 5, bias=bias)
        self.v_weight = nn.Parameter(torch.randn(2, 7))
        self.v_bias = nn.Parameter(torch.randn(2)) if bias else None

    def forward(self, x):
        return self.q(x), self.k(x), F.linear(x, self.v_weight, self.v_bias)


def test_projections_of_one_input_become_one_gemm_and_a_split():
    for bias in (True, False):
        gm, report = check_fusion(randomize(Heads(bias)), [torch.randn(4, 13, 7)], rules=["linear_same_input"])
        calls = count_calls(gm)
        assert calls == {"linear": 1, "split": 1, "getitem": 3}
        (record,) = report.records
        assert record.members == ("q", "k", "linear") and record.detail.endswith("-> 1 linear(7->10) + split")
        split = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.split)
        assert split.args[1:] == ([3, 5, 2], -1)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)
        self.c, self.d = nn.Linear(4, 3, bias=False), nn.Linear(4, 3, bias=False)
        self.e = nn.Linear(4, 3).double()
        self.w = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        computed = F.linear(x, self.w * 2)  # weight computed in the graph: not a candidate
        return self.a(x) + self.b(x) + self.c(x) + self.d(x) + computed, self.e(x.double())


def test_only_linears_with_the_same_signature_group():
    gm, report = check_fusion(randomize(Mixed()), [torch.randn(5, 4)], rules=["linear_same_input"])
    assert report.counts == {"linear_same_input": 2}
    assert [r.members for r in report.records] == [("a", "b"), ("c", "d")]
    assert count_calls(gm)["Linear"] == 1 and count_calls(gm)["linear"] == 3


class SharedModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x, y):
        return self.a(x) * self.b(x) + self.a(y)  # a is used twice: its weights must stay where they are


def test_a_module_used_twice_keeps_its_parameters():
    gm, report = check_fusion(randomize(SharedModule()), [torch.randn(5, 4), torch.randn(5, 4)],
                              rules=["linear_same_input"])
    assert report.counts == {"linear_same_input": 1}
    assert {"a.weight", "a.bias"} <= dict(gm.named_parameters()).keys()
    # no new parameter: the weights are concatenated on every call, so a's stay shared with the a(y) call
    assert not [n for n, _ in gm.named_parameters() if n.startswith("hfused")]
    assert count_calls(gm)["cat"] == 2 and count_calls(gm)["Linear"] == 1

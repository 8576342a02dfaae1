"""Slapo's pattern forms for find(): functions, call_module, Pattern and ModulePattern modules."""

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import schedlang as slapo
from schedlang.errors import PatternError
from schedlang.pattern import ModulePattern, Pattern, call_module


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.ReLU())
        self.fc1 = nn.Linear(5 * 7 * 7, 13)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(13, 11)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(11, 3)

    def forward(self, x):
        x = self.block(x).flatten(1)
        return self.head(self.act2(self.fc2(self.act1(self.fc1(x)))))


def _traced(model):
    sch = slapo.create_schedule(model)
    sch.trace()
    return sch


def test_pattern_module_with_module_pattern_matches_each_linear_relu_pair():
    class LinearReLU(Pattern):
        def __init__(self):
            super().__init__()
            self.fc = ModulePattern(r"fc\d")
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(self.fc(x))

    sch = _traced(ConvNet())
    found = sch.find(LinearReLU())
    assert [[n.target for _, n in sub] for sub in found] == [["fc1", "act1"], ["fc2", "act2"]]
    # the same with call_module in a function, and with the functional relu
    assert [[n.target for _, n in sub] for sub in sch.find(lambda x: F.relu(call_module(r"fc\d", x)))] == \
        [["fc1", "act1"], ["fc2", "act2"]]


def test_pattern_modules_match_by_type_not_size():
    class BNReLU(Pattern):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(64)   # the model's has 5 channels
            self.relu = nn.ReLU()

        def forward(self, x):
            return F.relu(self.bn(x))

    sch = _traced(ConvNet())
    (sub,) = sch["block"].find(BNReLU())
    assert [type(sch["block"].mod.get_submodule(n.target)) for _, n in sub] == [nn.BatchNorm2d, nn.ReLU]


def test_call_module_regex_finds_horizontal_projections():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            q, k, v = (p(x).view(2, 5, 2, 4).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
            return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    sch = _traced(Attn())
    found = sch.find(lambda x: call_module(r"[qkv]_proj", x).view(2, 5, 2, 4))
    assert [sub[0][1].target for sub in found] == ["q_proj", "k_proj", "v_proj"]
    assert all(len(sub) == 2 for sub in found)


def test_shared_intermediate_in_pattern_matches_a_diamond_only():
    class Diamond(nn.Module):
        def forward(self, x, y):
            a = x + y
            return a * 2 + a * 3, (x + y) * 2 + (x + y) * 5

    sch = _traced(Diamond())

    def pattern(m, n):
        a = m + n
        return a * 2 + a * 3

    (sub,) = sch.find(pattern)
    assert [n.target for _, n in sub] == [operator.add, operator.mul, operator.mul, operator.add]


def test_residual_relu_matches_module_and_functional_forms():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(x) + x

    sch = _traced(Residual())
    (sub,) = sch.find(lambda x: F.relu(x) + x)
    assert (sub[0][1].op, sub[0][1].target, sub[1][1].target) == ("call_module", "relu", operator.add)
    (sub,) = sch.find(lambda x: call_module("relu", x) + x)
    assert sub[0][1].target == "relu"


def test_module_pattern_rejects_a_bad_regex():
    with pytest.raises(PatternError, match=r"ModulePattern: invalid regex '\[fc'"):
        ModulePattern("[fc")


def test_pattern_is_not_run_and_says_so():
    with pytest.raises(PatternError, match="Pattern: define forward"):
        Pattern()(torch.randn(2))

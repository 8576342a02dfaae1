"""Pattern matching by dataflow and regex search over module names."""

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from schedlang.errors import PatternError
from schedlang.graph import call_module, find_nodes, find_subgraphs, trace_module
from schedlang.module_record import update_record


def _ops(subgraphs):
    """Each subgraph as the names of its nodes."""
    return [[node.name for _, node in sg] for sg in subgraphs]


class _BiasAct(nn.Module):
    def __init__(self, functional=True, swap=False):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(8))
        self.act = nn.GELU()
        self.functional, self.swap = functional, swap

    def forward(self, x):
        y = self.bias + x if self.swap else x + self.bias
        return F.gelu(y) if self.functional else self.act(y)


@pytest.mark.parametrize("functional", [True, False])
@pytest.mark.parametrize("swap", [False, True])
def test_chain_matches_functional_and_module_forms_and_both_add_orders(functional, swap):
    gm = trace_module(_BiasAct(functional, swap))
    found = find_subgraphs(gm, lambda x, b: F.gelu(x + b))
    assert len(found) == 1 and len(found[0]) == 2
    assert [n.op for _, n in found[0]] == ["call_function", "call_function" if functional else "call_module"]
    assert all(path == "" for path, _ in found[0])


def test_module_pattern_matches_functional_graph_and_back():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return torch.relu(F.linear(x, self.w))

    class Modular(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4, bias=False)
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(self.lin(x))

    assert _ops(find_subgraphs(trace_module(Functional()), Modular)) == [["linear", "relu"]]
    assert _ops(find_subgraphs(trace_module(Modular()), lambda x, w: F.relu(F.linear(x, w)))) == [["lin", "act"]]
    assert _ops(find_subgraphs(trace_module(Modular()), lambda x: x.relu())) == [["act"]]


class _Shapes(nn.Module):
    def forward(self, a, b, c, d):
        diamond = a * torch.sigmoid(a)
        tree = (a + b) * (c + d)
        two_paths = torch.tanh(c) - torch.exp(c)
        not_diamond = a * torch.sigmoid(b)
        return diamond, tree, two_paths, not_diamond


def test_diamond_tree_and_two_paths():
    gm = trace_module(_Shapes())
    # diamond: strict matching binds an input used twice to one value
    assert _ops(find_subgraphs(gm, lambda x: x * torch.sigmoid(x), strict=True)) == [["sigmoid", "mul"]]
    # by default (Slapo's rule) each use may bind another value; the exact match still comes first
    assert _ops(find_subgraphs(gm, lambda x: x * torch.sigmoid(x))) == [["sigmoid", "mul"], ["sigmoid_1", "mul_2"]]
    # tree, with commutative operands at every level
    assert _ops(find_subgraphs(gm, lambda p, q, r, s: (s + r) * (q + p))) == [["add", "add_1", "mul_1"]]
    assert _ops(find_subgraphs(gm, lambda x: torch.tanh(x) - torch.exp(x))) == [["tanh", "exp", "sub"]]
    # two outputs from one input, returned as a tuple
    assert _ops(find_subgraphs(gm, lambda x: (torch.tanh(x), torch.exp(x)))) == [["tanh", "exp"]]


def test_explicit_constants_must_match_and_omitted_ones_do_not():
    gm = trace_module(nn.Sequential(nn.Linear(3, 3), nn.GELU(approximate="tanh"), nn.Dropout(0.1)))
    assert find_subgraphs(gm, lambda x: F.gelu(x)) != []
    assert find_subgraphs(gm, lambda x: F.gelu(x, approximate="tanh")) != []
    assert find_subgraphs(gm, lambda x: F.gelu(x, approximate="none")) == []
    assert find_subgraphs(gm, lambda x: F.dropout(F.gelu(x))) != []
    assert find_subgraphs(gm, lambda x: F.dropout(x, p=0.1)) != []
    assert find_subgraphs(gm, lambda x: F.dropout(x, p=0.2)) == []


class _Chain(nn.Module):
    def forward(self, x):
        return torch.tanh(torch.tanh(torch.tanh(torch.tanh(torch.tanh(x)))))


def test_matches_never_overlap():
    found = find_subgraphs(trace_module(_Chain()), lambda x: torch.tanh(torch.tanh(x)))
    assert _ops(found) == [["tanh", "tanh_1"], ["tanh_2", "tanh_3"]]


class _Leaky(nn.Module):
    def forward(self, x, b):
        y = x + b
        return F.gelu(y), y * 2


def test_a_match_whose_intermediate_is_used_outside_is_reported_unless_strict():
    gm = trace_module(_Leaky())
    assert find_subgraphs(gm, lambda x, b: F.gelu(x + b), strict=True) == []
    assert _ops(find_subgraphs(gm, lambda x, b: F.gelu(x + b))) == [["add", "gelu"]]

    def with_intermediate(x, b):  # returning the intermediate makes it a legal match
        y = x + b
        return y, F.gelu(y)

    assert _ops(find_subgraphs(gm, with_intermediate)) == [["add", "gelu"]]


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        def heads(t):
            return t.view(t.shape[:-1] + (4, -1)).permute(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        y = F.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
        return self.out(y.permute(0, 2, 1, 3).reshape(x.shape))


def test_call_module_regex_inside_a_pattern():
    gm = trace_module(_Attention())

    def pattern(x):
        y = call_module(r"[qkv]_proj", x)
        return y.view(y.shape[:-1] + (4, -1)).permute(0, 2, 1, 3)

    found = find_subgraphs(gm, pattern)
    assert [sg[0][1].target for sg in found] == ["q_proj", "k_proj", "v_proj"]
    assert all(len(sg) == 6 for sg in found)
    assert find_subgraphs(gm, lambda x: call_module(r"^out$", x).permute(0, 2, 1, 3)) == []


def test_regex_over_module_names():
    gm = trace_module(nn.Sequential(_Attention(), nn.Linear(16, 2)))
    found = find_nodes(gm, r"[qkv]_proj")
    assert [(p, n.target) for p, n in found] == [("0", "q_proj"), ("0", "k_proj"), ("0", "v_proj")]
    assert [(p, n.target) for p, n in find_nodes(gm, r"^1$")] == [("", "1")]
    flat = trace_module(nn.Sequential(_Attention()), flatten=True)
    assert [n.target for _, n in find_nodes(flat, r"0\.[qk]_proj")] == ["0.q_proj", "0.k_proj"]


def test_patterns_are_found_in_every_traced_child():
    model = nn.Sequential(_BiasAct(), _BiasAct(), nn.Linear(8, 8))
    gm = trace_module(model)
    found = find_subgraphs(gm, lambda x, b: F.gelu(b + x))
    assert [sg[0][0] for sg in found] == ["0", "1"]
    for sg in found:
        for path, node in sg:
            assert node.graph is gm.get_submodule(path).graph


def test_pattern_given_as_module_class_or_instance():
    class Pattern(nn.Module):
        def forward(self, x, b):
            return F.gelu(torch.add(x, b))

    gm = trace_module(_BiasAct())
    assert _ops(find_subgraphs(gm, Pattern)) == _ops(find_subgraphs(gm, Pattern())) == [["add", "gelu"]]


def test_pattern_errors_are_explained():
    gm = trace_module(_BiasAct())
    with pytest.raises(PatternError, match=r"pattern <lambda> must return results of operations, but returns x "
                                           r"directly"):
        find_subgraphs(gm, lambda x: x)
    with pytest.raises(PatternError, match=r"pattern <lambda> takes \*args/\*\*kwargs; give every input a name"):
        find_subgraphs(gm, lambda *xs: xs[0] + 1)

    class NeedsArgs(nn.Module):
        def __init__(self, size):
            super().__init__()

        def forward(self, x):
            return x + 1

    with pytest.raises(PatternError, match=r"pattern module class .*NeedsArgs needs constructor arguments"):
        find_subgraphs(gm, NeedsArgs)
    with pytest.raises(PatternError, match=r"a pattern must be a regex string, a function or an nn.Module, got int"):
        find_subgraphs(gm, 3)
    with pytest.raises(PatternError, match=r"invalid regex '\[q': "):
        find_nodes(gm, "[q")
    with pytest.raises(PatternError, match=r"call_module: invalid regex '\(': "):
        find_subgraphs(gm, lambda x: call_module("(", x))
    with pytest.raises(PatternError, match=r"describes a module call inside a pattern function passed to find\(\); "
                                           r"it cannot be called on real tensors"):
        call_module("fc1", torch.randn(2))


def test_graph_modules_of_fused_or_checkpointed_regions_are_not_searched():
    model = nn.Sequential(_BiasAct(), _BiasAct())
    gm = trace_module(model)
    update_record(gm.get_submodule("1"), fused=True)
    assert [sg[0][0] for sg in find_subgraphs(gm, lambda x, b: F.gelu(b + x))] == ["0"]
    assert isinstance(gm, fx.GraphModule)

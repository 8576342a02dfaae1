import torch
from torch import fx

from schedlang.graph.passes._grouping import Reachability, SweepGuard, independent_sets


def _graph():
    def f(x, y):
        a = torch.tanh(x)
        b = torch.tanh(a)  # depends on a
        c = torch.tanh(y)
        d = torch.tanh(b + c)
        return d

    gm = fx.symbolic_trace(f)
    return gm, {n.name: n for n in gm.graph.nodes}


def test_reachability_and_independent_sets():
    gm, n = _graph()
    reach = Reachability(gm.graph)
    a, b, c, d = n["tanh"], n["tanh_1"], n["tanh_2"], n["tanh_3"]
    assert reach.is_ancestor(n["x"], b) and reach.is_ancestor(a, d) and reach.is_ancestor(a, a)
    assert not reach.is_ancestor(c, b) and not reach.is_ancestor(b, a)
    sets = independent_sets([n["tanh"], n["tanh_1"], n["tanh_2"], n["tanh_3"]], reach)
    assert [[m.name for m in s] for s in sets] == [["tanh", "tanh_2"], ["tanh_1"], ["tanh_3"]]


class CrossedPairs(torch.nn.Module):
    def forward(self, x, y):
        a1 = torch.relu(x)
        b1 = torch.sigmoid(a1)
        b2 = torch.sigmoid(y)
        a2 = torch.relu(b2)
        return a2, b1


def test_the_driver_fuses_crossed_pairs_without_a_cycle():
    from torch.fx.passes.shape_prop import ShapeProp

    from .models import check_fusion

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    gm = fx.symbolic_trace(CrossedPairs())
    ShapeProp(gm).propagate(x, y)
    _, report = check_fusion(CrossedPairs(), [x, y], gm=gm, rules=["activation"])
    assert report.counts == {"activation": 1}  # fusing both pairs would need b2 before and after b1


def test_sweep_guard_defers_a_set_that_a_previous_fusion_could_close_into_a_cycle():
    # a1 -> b1 and b2 -> a2. Fusing {a1, a2} makes b2 feed b1, so {b1, b2} must wait.
    gm = fx.symbolic_trace(CrossedPairs())
    n = {m.name: m for m in gm.graph.nodes}
    reach = Reachability(gm.graph)
    guard = SweepGuard(reach)
    assert guard.allows([n["relu"], n["relu_1"]])
    guard.record([n["relu"], n["relu_1"]])
    assert not guard.allows([n["sigmoid"], n["sigmoid_1"]])
    assert guard.allows([n["sigmoid"]])

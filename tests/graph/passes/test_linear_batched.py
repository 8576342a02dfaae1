import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from .models import BranchesOnPieces, check_fusion, count_calls, randomize


class Towers(nn.Module):
    def __init__(self, n=3, d_in=5, d_out=4, bias=True):
        super().__init__()
        self.towers = nn.ModuleList(nn.Linear(d_in, d_out, bias=bias) for _ in range(n))

    def forward(self, x0, x1, x2):
        return tuple(t(x) for t, x in zip(self.towers, (x0, x1, x2)))


def _with_shapes(model, inputs):
    gm = fx.symbolic_trace(model)
    ShapeProp(gm).propagate(*inputs)
    return gm


def test_linears_on_inputs_of_one_shape_become_one_batched_matmul():
    for bias in (True, False):
        model = randomize(Towers(bias=bias))
        inputs = [torch.randn(2, 7, 5) for _ in range(3)]
        gm, report = check_fusion(model, inputs, gm=_with_shapes(model, inputs), rules=["linear_batched"])
        assert count_calls(gm) == {"stack": 1, "batched_linear": 1, "unbind": 1, "getitem": 3}
        assert report.records[0].detail == "3 x linear(5->4) on different inputs -> 1 batched_linear (baddbmm over 3 " \
                                           "stacked inputs)"
        weight = next(p for n, p in gm.named_parameters() if "weight" in n)
        assert weight.shape == (3, 4, 5)


def test_inputs_of_different_or_unknown_shapes_are_not_batched():
    model = randomize(Towers())
    inputs = [torch.randn(7, 5), torch.randn(6, 5), torch.randn(7, 5)]
    gm, report = check_fusion(model, inputs, gm=_with_shapes(model, inputs), rules=["linear_batched"])
    assert [r.members for r in report.records] == [("towers_0", "towers_2")]
    _, report = check_fusion(model, inputs, rules=["linear_batched"])  # no shapes recorded: nothing is provable
    assert len(report) == 0


def test_pieces_of_one_split_are_batched_without_shapes():
    # float64: a layer norm over two values is ill-conditioned, and bmm and mm round differently
    model = randomize(BranchesOnPieces(n=4, d_in=3, d=2)).double()
    gm, report = check_fusion(model, [torch.randn(9, 12, dtype=torch.float64)], rules=["linear_batched"])
    assert report.counts == {"linear_batched": 1} and count_calls(gm)["batched_linear"] == 1

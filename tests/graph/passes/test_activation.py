import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from .models import check_fusion, count_calls


class EveryPiece(nn.Module):
    def __init__(self, sizes=(3, 5, 2)):
        super().__init__()
        self.sizes = list(sizes)

    def forward(self, x):
        p = torch.split(x, self.sizes, -1)
        return [torch.relu(p[i]) for i in range(len(self.sizes))]


def test_an_activation_on_every_piece_runs_once_on_the_whole_tensor():
    gm, report = check_fusion(EveryPiece(), [torch.randn(4, 10)], rules=["activation"])
    assert count_calls(gm) == {"relu": 1, "split": 1, "getitem": 3}
    assert report.records[0].detail == "3 x relu on the pieces of 'split' -> 1 relu on 'x' + split"


class Gates(nn.Module):
    """LSTM-style gates: three sigmoids and one tanh over the four chunks of one tensor."""

    def __init__(self, list_sizes):
        super().__init__()
        self.list_sizes = list_sizes

    def forward(self, x):
        i, f, g, o = torch.split(x, [6, 6, 6, 6], -1) if self.list_sizes else x.split(6, -1)
        return torch.sigmoid(i) * torch.tanh(g) + F.sigmoid(f) * o.sigmoid()


def test_part_of_the_pieces_are_stacked_instead():
    gm, report = check_fusion(Gates(list_sizes=True), [torch.randn(5, 24)], rules=["activation"])
    calls = count_calls(gm)
    assert calls["sigmoid"] == 1 and calls["tanh"] == 1 and calls["stack"] == 1
    assert report.records[0].detail == "3 x sigmoid -> 1 sigmoid over 3 stacked tensors"
    # with x.split(6) the last piece may be shorter than 6 (x of width 22): stacking it is not safe,
    # so the sigmoid on it stays apart and the other two are stacked
    gm, report = check_fusion(Gates(list_sizes=False), [torch.randn(5, 24)], rules=["activation"])
    assert [r.members for r in report.records] == [("sigmoid", "sigmoid_1")]
    assert count_calls(gm)["sigmoid"] == 2 and count_calls(gm)["stack"] == 1


class Uneven(nn.Module):
    def forward(self, x):
        a, b, c = torch.split(x, [2, 3, 4], -1)
        return torch.tanh(a), torch.tanh(b), c  # pieces of different sizes, not all used: no fusion


def test_pieces_of_different_sizes_are_not_stacked():
    _, report = check_fusion(Uneven(), [torch.randn(3, 9)], rules=["activation"])
    assert len(report) == 0


class Forms(nn.Module):
    def __init__(self):
        super().__init__()
        self.gelu_tanh = nn.ModuleList(nn.GELU(approximate="tanh") for _ in range(2))
        self.inplace = nn.ReLU(inplace=True)

    def forward(self, x):
        p = x.unbind(0)
        return (F.gelu(p[0]), F.gelu(p[1]), self.gelu_tanh[0](p[2]), self.gelu_tanh[1](p[3]),
                F.relu(p[4] + 1, inplace=True), self.inplace(p[5] * 2))


def test_gelu_approximations_group_separately_and_in_place_forms_stay():
    gm, report = check_fusion(Forms(), [torch.randn(6, 3, 4)], rules=["activation"])
    assert [r.detail for r in report.records] == ["2 x gelu -> 1 gelu over 2 stacked tensors",
                                                   "2 x gelu(tanh) -> 1 gelu(tanh) over 2 stacked tensors"]
    assert count_calls(gm)["relu"] == 1 and count_calls(gm)["ReLU"] == 1


class Separate(nn.Module):
    def forward(self, x, y, z):
        return torch.tanh(x), torch.tanh(y), torch.tanh(z)


def test_same_shape_tensors_are_stacked_when_shapes_are_known():
    inputs = [torch.randn(3, 7), torch.randn(3, 7), torch.randn(7, 3)]
    gm = fx.symbolic_trace(Separate())
    ShapeProp(gm).propagate(*inputs)
    fused, report = check_fusion(Separate(), inputs, gm=gm, rules=["activation"])
    assert [r.members for r in report.records] == [("tanh", "tanh_1")]
    assert count_calls(fused)["tanh"] == 2

import torch
from torch import nn

from .models import check_fusion, count_calls


class Stacks(nn.Module):
    def forward(self, t, x, y):
        u = t.unbind(1)
        same = torch.stack([u[0], u[1], u[2]], 1)
        moved = torch.stack(u, 0)
        run = torch.stack([u[1], u[2]], 1)
        s = x.split(4, -1)
        view = torch.stack([s[0], s[1], s[2]], -2)
        back = torch.stack([x, y], 0).unbind(0)
        return same * 2, moved + 1, run - 1, view * 3, back[1] + 2


def test_stack_round_trips_become_views():
    inputs = [torch.randn(2, 3, 5), torch.randn(7, 12), torch.randn(7, 12)]
    gm, report = check_fusion(Stacks(), inputs, rules=["stack_unbind"])
    assert report.counts == {"stack_unbind": 5}
    calls = count_calls(gm)
    assert calls.get("stack", 0) == 0 and calls.get("getitem", 0) == 0
    # without shapes the number of pieces of t.unbind(1) and x.split(4) is unknown: same, run and view
    # take a narrow view of the pieces they stack (a no-op when they are all the pieces)
    assert calls["movedim"] == 1 and calls["unflatten"] == 1 and calls["narrow"] == 3


class Unequal(nn.Module):
    def forward(self, x):
        s = torch.split(x, [3, 3, 2], -1)
        return torch.stack([s[0], s[1]], -2)  # equal pieces 0 and 1: a view of the first 6 columns


def test_equal_pieces_of_an_uneven_split():
    gm, report = check_fusion(Unequal(), [torch.randn(4, 8)], rules=["stack_unbind"])
    assert count_calls(gm) == {"narrow": 1, "unflatten": 1}

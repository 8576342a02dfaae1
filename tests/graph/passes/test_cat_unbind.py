import torch
from torch import nn

from .models import check_fusion, count_calls


class Cats(nn.Module):
    def forward(self, t, y):
        u = t.unbind(-2)
        last = torch.cat([u[0], u[1], u[2]], -1)  # (B, N, D) -> (B, N*D)
        first = torch.cat(t.unbind(0), 0)
        mixed = torch.cat([u[0], u[1], u[2]], 0)  # group dim -2, cat dim 0: rank needed at run time
        inner = torch.cat([y, u[1], u[2]], -1)
        return last, first, mixed, inner


def test_cat_of_unbind_pieces_is_a_flatten():
    gm, report = check_fusion(Cats(), [torch.randn(4, 3, 5), torch.randn(4, 2)], rules=["cat_unbind"])
    assert report.counts == {"cat_unbind": 4}
    calls = count_calls(gm)
    assert calls["flatten"] == 3 and calls["merge_group_dim"] == 1 and calls["cat"] == 1

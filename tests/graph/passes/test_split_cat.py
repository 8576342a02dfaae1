import pytest
import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from .models import check_fusion, count_calls


class RoundTrips(nn.Module):
    def forward(self, x, y):
        s = torch.split(x, [2, 3, 4], -1)
        whole = torch.cat([s[0], s[1], s[2]], -1)
        direct = torch.cat(x.split(3, 0), 0)
        partial = torch.cat([y, s[1], s[2], y], -1)
        shuffled = torch.cat([s[1], s[0]], -1)  # out of order: a real copy, kept
        across = torch.cat([s[0], s[0]], 0)  # not consecutive pieces: kept
        return whole * 2, direct + 1, partial, shuffled, across


def test_cat_of_split_pieces_is_the_input_or_a_narrow_view():
    gm, report = check_fusion(RoundTrips(), [torch.randn(6, 9), torch.randn(6, 2)], rules=["split_cat"])
    assert report.counts == {"split_cat": 3}
    calls = count_calls(gm)
    assert calls["cat"] == 3 and calls["narrow"] == 1  # partial, shuffled, across
    assert calls["split"] == 1  # x.split(3, 0) is gone


class SignedDims(nn.Module):
    def forward(self, x):
        s = x.split(2, 1)
        return torch.cat([s[0], s[1], s[2]], -1)


def test_dims_of_either_sign_match_when_the_rank_is_known():
    x = torch.randn(4, 6)
    _, report = check_fusion(SignedDims(), [x], rules=["split_cat"])
    assert len(report) == 0  # rank unknown: split dim 1 and cat dim -1 cannot be proven equal
    gm = fx.symbolic_trace(SignedDims())
    ShapeProp(gm).propagate(x)
    fused, report = check_fusion(SignedDims(), [x], gm=gm, rules=["split_cat"])
    assert report.counts == {"split_cat": 1} and count_calls(fused) == {}


class RunToTheEnd(nn.Module):
    def forward(self, x, y):
        s = x.split(4, 1)
        return torch.cat([s[0], s[1], s[2]], 1) * 2, torch.cat([y, s[1], s[2]], 1)


def test_a_run_ending_with_a_piece_of_unknown_size_is_a_span_checked_at_run_time():
    model = RunToTheEnd()
    fused = None
    for width in (12, 10, 9, 15):  # whole, the last piece short, and one piece more than used
        fused, report = check_fusion(model, [torch.randn(3, width), torch.randn(3, 2)], rules=["split_cat"])
        assert report.counts == {"split_cat": 2}
        assert count_calls(fused) == {"span_of_pieces": 2, "cat": 1, "mul": 1}
    with pytest.raises(IndexError):  # piece 2 does not exist: the unfused graph raises too
        fused(torch.randn(3, 8), torch.randn(3, 2))
    with pytest.raises(IndexError):
        RunToTheEnd()(torch.randn(3, 8), torch.randn(3, 2))

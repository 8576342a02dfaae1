import torch
import torch.nn.functional as F
from torch import nn

from .models import check_fusion, count_calls, randomize


class NormsOverUnbind(nn.Module):
    def __init__(self, n=3, shape=(6,), affine=True, bias=True, eps=1e-5):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(shape, eps=eps, elementwise_affine=affine, bias=bias)
                                   for _ in range(n))

    def forward(self, x):
        parts = x.unbind(1)
        return [norm(parts[i]) for i, norm in enumerate(self.norms)]


def test_norms_over_the_pieces_of_an_unbind():
    for affine, bias in ((True, True), (True, False), (False, False)):
        model = randomize(NormsOverUnbind(affine=affine, bias=bias))
        gm, report = check_fusion(model, [torch.randn(4, 3, 6)], rules=["layer_norm"])
        assert count_calls(gm)["group_layer_norm"] == 1 and "LayerNorm" not in count_calls(gm)
        assert report.records[0].detail == "3 x layer_norm(6,) -> 1 group_layer_norm over 3 stacked pieces"


def test_multi_dimensional_normalized_shape():
    model = randomize(NormsOverUnbind(n=2, shape=(4, 5)))
    gm, _ = check_fusion(model, [torch.randn(3, 2, 4, 5)], rules=["layer_norm"])
    assert count_calls(gm)["group_layer_norm"] == 1


class DifferentEps(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.LayerNorm(4), nn.LayerNorm(4, eps=1e-3), nn.LayerNorm(4)
        self.g = nn.Parameter(torch.randn(4))

    def forward(self, x):
        p = x.split(4, -1)
        return self.a(p[0]), self.b(p[1]), self.c(p[2]), F.layer_norm(p[3], (4,), self.g, None)


def test_only_norms_with_equal_settings_group():
    gm, report = check_fusion(randomize(DifferentEps()), [torch.randn(5, 16)], rules=["layer_norm"])
    assert [r.members for r in report.records] == [("a", "c")]
    assert count_calls(gm)["LayerNorm"] == 1 and count_calls(gm)["layer_norm"] == 1


class NormsOverRows(nn.Module):
    """Layer norms over the pieces ``x.split(3, 1)`` of a (B, W, 4) tensor; ``used`` says which pieces."""

    def __init__(self, used=(0, 1, 2, 3)):
        super().__init__()
        self.used = used
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in used)

    def forward(self, x):
        parts = x.split(3, 1)
        return [norm(parts[i]) for i, norm in zip(self.used, self.norms)]


def test_every_piece_of_an_int_split_with_a_last_piece_of_unknown_size_is_one_guarded_norm():
    model = randomize(NormsOverRows())
    for width in (12, 11, 10, 14):  # all whole, the last piece short by 1 and by 2, one piece more (unused)
        gm, report = check_fusion(model, [torch.randn(5, width, 4)], rules=["layer_norm"])
        assert [r.members for r in report.records] == [("norms_0", "norms_1", "norms_2", "norms_3")]
        assert report.records[0].detail == ("4 x layer_norm(4,) on the pieces of 'split' -> 1 piecewise_layer_norm "
                                            "on 'x' (one group layer norm when all 4 pieces are whole, else one per "
                                            "piece)")
        assert "LayerNorm" not in count_calls(gm)


def test_pieces_given_in_any_order_keep_their_own_weights():
    model = randomize(NormsOverRows(used=(2, 0, 3, 1)))
    gm, report = check_fusion(model, [torch.randn(5, 11, 4)], rules=["layer_norm"])
    assert count_calls(gm)["piecewise_layer_norm"] == 1
    assert report.records[0].members == ("norms_1", "norms_3", "norms_0", "norms_2")  # by piece index


def test_a_possibly_shorter_piece_in_a_partial_group_stays_apart():
    # pieces 0, 2, 3 of four: the group is not every piece, so piece 3 (maybe short) cannot be guarded
    # by the piecewise op and cannot be stacked; 0 and 2 still stack
    model = randomize(NormsOverRows(used=(0, 2, 3)))
    gm, report = check_fusion(model, [torch.randn(5, 11, 4)], rules=["layer_norm"])
    assert [r.members for r in report.records] == [("norms_0", "norms_1")]
    assert count_calls(gm)["LayerNorm"] == 1 and count_calls(gm)["group_layer_norm"] == 1

"""Rule ``embedding_bags``: embedding bags over the pieces of a sparse-feature split -> one lookup."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import schedlang
from schedlang.graph.passes.combine_sparse_features import combine_sparse_inputs
from schedlang.graph.passes.horizontal import fused_parameter_sources, horizontal_fuse
from schedlang.sparse import combine_sparse_features

from .models import assert_close_scaled, compare_parameters, count_calls, run_with_grads

SIZES = [3, 17, 1, 8, 30, 5, 11]  # rows of the 7 tables
FEATURES = [(f"i{k}", f"l{k}") for k in range(7)]


def exclusive_offsets(lengths):
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])


class SevenBags(nn.Module):
    """Seven sparse features, each pooled by its own table (irregular sizes), concatenated or not."""

    def __init__(self, mode="sum", concat=True, dim=6):
        super().__init__()
        self.concat = concat
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode=mode) for rows in SIZES)

    def forward(self, i0, l0, i1, l1, i2, l2, i3, l3, i4, l4, i5, l5, i6, l6):
        pairs = ((i0, l0), (i1, l1), (i2, l2), (i3, l3), (i4, l4), (i5, l5), (i6, l6))
        pooled = [bag(i, exclusive_offsets(l)) for bag, (i, l) in zip(self.bags, pairs)]
        return torch.cat(pooled, -1) if self.concat else tuple(pooled)


def batch(sizes=SIZES, size=13, dtype=torch.int64, seed=0):
    """Irregular lengths with empty samples, and one feature (the fifth) with no index at all."""
    gen = torch.Generator().manual_seed(seed)
    feats = []
    for f, rows in enumerate(sizes):
        lengths = torch.randint(0, 4, (size,), generator=gen)
        lengths[f % size] = 0
        if f == 4:
            lengths.zero_()
        feats.append((torch.randint(0, rows, (int(lengths.sum()),), generator=gen).to(dtype), lengths.to(dtype)))
    return feats


def fuse(model, features=FEATURES, rules=("embedding_bags", "cat_unbind")):
    """Trace ``model``, make it take its features combined, then fuse; returns (fused, report)."""
    gm = fx.symbolic_trace(model)
    combine_sparse_inputs(gm, features)
    fused = copy.deepcopy(gm)
    report = horizontal_fuse(fused, rules=list(rules) if rules is not None else None)
    fused.graph.lint()
    return fused, report


def check(model, fused, feats, extra=(), atol=1e-5, rtol=1.3e-6):
    """Outputs and every original parameter's gradient, fused (combined inputs) against the model."""
    flat = [t for pair in feats for t in pair]
    ref_out, _ = run_with_grads(model, list(extra) + flat)
    out, _ = run_with_grads(fused, list(extra) + list(combine_sparse_features(feats)))
    assert len(out) == len(ref_out)
    for a, b in zip(out, ref_out):
        assert_close_scaled(a, b, atol, rtol)
    compare_parameters(model, fused, atol, rtol)


def randomize(model):
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("concat", [True, False])
def test_seven_bags_become_one_lookup(mode, concat):
    model = randomize(SevenBags(mode, concat))
    fused, report = fuse(model)
    assert report.counts == ({"embedding_bags": 1, "cat_unbind": 1} if concat else {"embedding_bags": 1})
    calls = count_calls(fused)
    assert calls.get("EmbeddingBag", 0) == 0 and calls["pooled_embedding_bags"] == 1
    assert "getitem" not in calls or not concat  # the split's pieces are gone: nothing asks for them
    (record,) = [r for r in report.records if r.rule == "embedding_bags"]
    assert record.detail == (f"7 x embedding_bag({mode}, 6 wide) on features of 'split_sparse_features' "
                             f"-> 1 embedding_bag over {sum(SIZES)} rows of 7 table(s)")
    (info,) = fused_parameter_sources(fused).values()
    assert info.shape == (sum(SIZES), 6) and [s.name for s in info.sources] == [f"bags.{k}.weight" for k in range(7)]
    assert fused.hfused_embedding_bag_rows_0.tolist() == [0, 3, 20, 21, 29, 59, 64]
    assert "hfused_embedding_bag_rows_0" not in fused.state_dict()
    for dtype in (torch.int64, torch.int32):
        check(model, fused, batch(dtype=dtype, seed=int(dtype == torch.int32)))


def test_the_fused_model_never_asks_for_the_pieces(monkeypatch):
    model = randomize(SevenBags())
    fused, _ = fuse(model)
    feats = batch()
    expected = model(*[t for pair in feats for t in pair])
    indices, lengths = combine_sparse_features(feats)

    def refuse(*args, **kwargs):
        raise AssertionError("device-to-host copy")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    torch.testing.assert_close(fused(indices, lengths), expected)


class OffsetStyles(nn.Module):
    """The ways models compute bag offsets from lengths, as modules and as F.embedding_bag."""

    def __init__(self):
        super().__init__()
        self.a = nn.EmbeddingBag(9, 4, mode="sum")
        self.b = nn.EmbeddingBag(5, 4, mode="sum", include_last_offset=True)
        self.c = nn.EmbeddingBag(12, 4, mode="sum")
        self.tables = nn.ParameterList(nn.Parameter(torch.randn(r, 4)) for r in (7, 3))

    def forward(self, ai, al, bi, bl, ci, cl, di, dl, ei, el):
        a = self.a(ai, exclusive_offsets(al))
        b = self.b(bi, F.pad(bl.cumsum(0), (1, 0)))
        c = self.c(ci, cl.cumsum(0) - cl)
        zero = torch.zeros(1, dtype=dl.dtype, device=dl.device)
        d = F.embedding_bag(di, self.tables[0], torch.cat([zero, dl.cumsum(0)[:-1]]), mode="sum")
        e = F.embedding_bag(ei, self.tables[1], F.pad(el, (1, 0)).cumsum(0), mode="sum", include_last_offset=True)
        return a + b + c + d + e


def test_every_offset_style_is_recognized():
    model = randomize(OffsetStyles())
    names = [(f"{x}i", f"{x}l") for x in "abcde"]
    fused, report = fuse(model, names)
    assert report.counts == {"embedding_bags": 1}
    assert report.records[0].members == ("a", "b", "c", "embedding_bag", "embedding_bag_1")
    check(model, fused, batch([9, 5, 12, 7, 3], size=7))


class NotOffsets(nn.Module):
    """Bags whose offsets are not those of their own lengths, and bags the rule must leave alone."""

    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(10, 4, mode="sum") for _ in range(3))
        self.padded = nn.ModuleList(nn.EmbeddingBag(10, 4, mode="sum", padding_idx=0) for _ in range(2))
        self.pair = nn.ModuleList(nn.EmbeddingBag(10, 4, mode="sum") for _ in range(2))

    def forward(self, i0, l0, i1, l1, i2, l2, i3, l3, i4, l4, i5, l5, i6, l6):
        inclusive = self.bags[0](i0, torch.cat([l0.new_zeros(1), l0.cumsum(0)])[1:])  # cumsum without the 0 start
        other = self.bags[1](i1, exclusive_offsets(l2))  # another feature's lengths
        weighted = self.bags[2](i2, exclusive_offsets(l2), torch.ones_like(i2, dtype=torch.float))
        padded = self.padded[0](i3, exclusive_offsets(l3)) + self.padded[1](i4, exclusive_offsets(l4))
        # the last two do qualify (with each other), while feature 6's lengths also feed a dense branch
        kept = self.pair[0](i5, exclusive_offsets(l5)) * self.pair[1](i6, exclusive_offsets(l6))
        return inclusive + other + weighted + padded + kept + l6.float().sum()


def test_only_bags_over_their_own_lengths_fuse():
    model = randomize(NotOffsets())
    fused, report = fuse(model)
    assert [r.members for r in report.records] == [("pair_0", "pair_1")]
    calls = count_calls(fused)
    assert calls["EmbeddingBag"] == 5 and calls["pooled_embedding_bags"] == 1
    assert fused.hfused_embedding_bag_rows_0.tolist() == [-1, -1, -1, -1, -1, 0, 10]
    check(model, fused, batch([10] * 7, size=6))


class SharedTable(nn.Module):
    """One table read by two features, and a table used outside the bags too."""

    def __init__(self):
        super().__init__()
        self.shared = nn.EmbeddingBag(20, 5, mode="mean")
        self.own = nn.EmbeddingBag(6, 5, mode="mean")

    def forward(self, ai, al, bi, bl, ci, cl):
        a = self.shared(ai, exclusive_offsets(al))
        b = self.shared(bi, exclusive_offsets(bl))
        c = self.own(ci, exclusive_offsets(cl))
        return torch.cat([a, b, c], -1) + self.own.weight[:1].repeat(1, 3)


def test_shared_tables_stay_shared():
    model = randomize(SharedTable())
    fused, report = fuse(model, [("ai", "al"), ("bi", "bl"), ("ci", "cl")])
    assert report.counts["embedding_bags"] == 1
    assert report.records[0].detail.endswith("-> 1 embedding_bag over 26 rows of 2 table(s)")
    assert fused_parameter_sources(fused) == {}  # concatenated on every call: the originals keep training
    assert fused.hfused_embedding_bag_rows_0.tolist() == [0, 0, 20]
    check(model, fused, batch([20, 20, 6], size=9))


def test_through_the_schedule_and_a_replay():
    model = randomize(SevenBags("mean"))
    sch = schedlang.create_schedule(model)
    sch.trace()
    sch.combine_sparse_features(FEATURES)
    report = sch.horizontal_fuse()
    assert report.counts == {"embedding_bags": 1, "cat_unbind": 1}
    feats = batch(seed=3)
    expected = model(*[t for pair in feats for t in pair])
    torch.testing.assert_close(sch.mod(*combine_sparse_features(feats)), expected)
    again = schedlang.replay(sch.plan.to_json(), model)
    torch.testing.assert_close(again.mod(*combine_sparse_features(feats)), expected)


@pytest.mark.gpu
def test_the_fused_model_does_not_synchronize_on_the_gpu():
    model = randomize(SevenBags("sum")).cuda()
    fused, _ = fuse(model)
    feats = batch()
    indices, lengths = (t.cuda() for t in combine_sparse_features(feats))
    expected = model(*[t.cuda() for pair in feats for t in pair])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fused(indices, lengths)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("body,include_last,recognized", [
    ("torch.cat([l.new_zeros(1), l.cumsum(0)[:-1]])", False, True),
    ("l.cumsum(0) - l", False, True),
    ("F.pad(l.cumsum(0), (1, 0))", True, True),
    ("F.pad(l.cumsum(0), (1, 0))", False, False),  # B + 1 numbers where B are wanted
    ("torch.cat([l.new_zeros(1), l.cumsum(0)[:5]])", False, False),  # right for a batch of 6 only
    ("l.cumsum(0)", False, False),  # each bag's end, not its start
    ("torch.cat([l.new_zeros(1), l.cumsum(0)[:-1]]) + w.shape[0] * 0", False, False),  # reads a parameter
    ("l.cumsum_(0)", False, False),  # in place: not among the ops read
])
def test_offsets_are_recognized_by_what_they_compute(body, include_last, recognized):
    from schedlang.graph.passes.embedding_bags import offsets_from_lengths

    class Offsets(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 2))

        def forward(self, l):
            w = self.w  # noqa: F841 (read by some bodies)
            return eval(body)

    gm = fx.symbolic_trace(Offsets())
    lengths = next(n for n in gm.graph.nodes if n.op == "placeholder")
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    nodes = offsets_from_lengths(output, [lengths], include_last)
    assert (nodes is not None) == recognized
    if recognized:
        assert nodes[-1] is output and lengths not in nodes


def test_a_failing_rule_leaves_no_buffer_or_parameter_behind(monkeypatch):
    """The row-offset buffer, like the fused table, is registered only when the rewrite commits."""
    from schedlang.graph.passes.horizontal import RULES

    model = randomize(SevenBags())
    gm = fx.symbolic_trace(model)
    combine_sparse_inputs(gm, FEATURES)
    code, params, buffers = gm.code, dict(gm.named_parameters()), dict(gm.named_buffers())
    original = type(RULES["embedding_bags"]).rewrite

    def broken(self, ctx, key, members):
        original(self, ctx, key, members)  # the buffer and the table are made on the private copy ...
        raise RuntimeError("boom")  # ... then a failure

    monkeypatch.setattr(type(RULES["embedding_bags"]), "rewrite", broken)
    with pytest.raises(RuntimeError, match="boom"):
        horizontal_fuse(gm, rules=["embedding_bags"])
    assert gm.code == code and dict(gm.named_parameters()) == params and dict(gm.named_buffers()) == buffers
    feats = batch()
    torch.testing.assert_close(gm(*combine_sparse_features(feats)), model(*[t for p in feats for t in p]))

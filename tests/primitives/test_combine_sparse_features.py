"""``Schedule.combine_sparse_features``: the traced model takes one (indices, lengths) pair."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import schedlang
from schedlang.sparse import combine_sparse_features


class Recommender(nn.Module):
    """A dense input and three sparse features, each pooled by its own embedding table."""

    def __init__(self, dim=6, vocab=50):
        super().__init__()
        self.tables = nn.ParameterList(nn.Parameter(torch.randn(vocab, dim)) for _ in range(3))
        self.dense = nn.Linear(4, dim)

    @staticmethod
    def offsets(lengths):
        return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])

    def forward(self, dense, a_idx, a_len, b_idx, b_len, c_idx, c_len):
        pooled = [F.embedding_bag(i, t, self.offsets(l), mode="sum")
                  for t, (i, l) in zip(self.tables, ((a_idx, a_len), (b_idx, b_len), (c_idx, c_len)))]
        return self.dense(dense) + pooled[0] * pooled[1] - pooled[2]


FEATURES = [("a_idx", "a_len"), ("b_idx", "b_len"), ("c_idx", "c_len")]


def _batch(batch=7, vocab=50):
    feats = []
    for _ in range(3):
        lengths = torch.randint(0, 5, (batch,))
        feats.append((torch.randint(0, vocab, (int(lengths.sum()),)), lengths))
    return torch.randn(batch, 4), feats


def _call(sch, *args, **kwargs):
    if hasattr(type(sch), "combine_sparse_features"):
        return sch.combine_sparse_features(*args, **kwargs)
    return sch._run("combine_sparse_features", features=args[0], **kwargs)


def test_the_rewritten_model_takes_the_combined_pair():
    model = Recommender()
    sch = schedlang.create_schedule(fx.symbolic_trace(model))
    layout = _call(sch, FEATURES)
    placeholders = [n.target for n in sch.mod.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["dense", "sparse_indices", "sparse_lengths"]
    assert str(layout) == "3 sparse features [(a_idx, a_len), (b_idx, b_len), (c_idx, c_len)] -> inputs " \
                          "(sparse_indices, sparse_lengths)"
    dense, feats = _batch()
    expected = model(dense, *[t for pair in feats for t in pair])
    indices, lengths = combine_sparse_features(feats)
    torch.testing.assert_close(sch.mod(dense, indices, lengths), expected)
    named = {name: t for (i, l), (ti, tl) in zip(FEATURES, feats) for name, t in ((i, ti), (l, tl))}
    torch.testing.assert_close(sch.mod(dense, *layout.combine(named)), expected)
    step = sch.plan[-1]
    assert step.args == {"features": [list(p) for p in FEATURES], "names": ["sparse_indices", "sparse_lengths"]}
    again = schedlang.replay(sch.plan.to_json(), fx.symbolic_trace(model))
    torch.testing.assert_close(again.mod(dense, indices, lengths), expected)


def test_features_in_another_order_and_custom_names():
    model = Recommender()
    sch = schedlang.create_schedule(fx.symbolic_trace(model))
    _call(sch, [("c_idx", "c_len"), ("a_idx", "a_len")], names=("ids", "lens"))
    assert [n.target for n in sch.mod.graph.nodes if n.op == "placeholder"] == ["dense", "ids", "lens", "b_idx",
                                                                              "b_len"]
    dense, feats = _batch(batch=5)
    expected = model(dense, *[t for pair in feats for t in pair])
    ids, lens = combine_sparse_features([feats[2], feats[0]])
    torch.testing.assert_close(sch.mod(dense, ids, lens, *feats[1]), expected)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(features=[]), schedlang.ScheduleTypeError,
     r"^<root>: combine_sparse_features expects a non-empty list of \(indices_input, lengths_input\) name pairs, "
     r"got \[\]; inputs are dense, a_idx, a_len, b_idx, b_len, c_idx, c_len$"),
    (dict(features=[("a_idx",)]), schedlang.ScheduleTypeError,
     r"^<root>: sparse feature 0 must be a pair of input names \(indices, lengths\), got \('a_idx',\)$"),
    (dict(features=[("a_idx", "a_len"), ("z_idx", "z_len")]), schedlang.ScheduleKeyError,
     r"^<root>: sparse feature 1 names 'z_idx', which is not an input of the traced forward; inputs are dense, "),
    (dict(features=[("a_idx", "a_len"), ("a_idx", "b_len")]), schedlang.ScheduleValueError,
     r"^<root>: input 'a_idx' appears twice in the sparse features; each input must appear once$"),
    (dict(features=FEATURES, names=("dense", "lens")), schedlang.ScheduleValueError,
     r"^<root>: combined input name 'dense' is already an input of the traced forward; choose another with "
     r"names=\(...\)$"),
    (dict(features=FEATURES, names=("x",)), schedlang.ScheduleValueError,
     r"^<root>: names must be two different identifiers for the combined inputs, got \('x',\)$"),
])
def test_bad_arguments_change_nothing(kwargs, error, message):
    sch = schedlang.create_schedule(fx.symbolic_trace(Recommender()))
    code = sch.mod.code
    with pytest.raises(error, match=message):
        sch._run("combine_sparse_features", **kwargs)
    assert sch.mod.code == code and len(sch.plan) == 0


def test_an_untraced_model_is_refused():
    sch = schedlang.create_schedule(Recommender())
    with pytest.raises(schedlang.NotTracedError,
                       match=r"^<root>: combine_sparse_features needs a traced module, but this is Recommender; call "
                             r"sch\.trace\(\) first$"):
        sch._run("combine_sparse_features", features=FEATURES)

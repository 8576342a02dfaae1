from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F

import schedlang
from schedlang.sparse import SparseFeatureSplit, combine_sparse_features, pooled_embedding_bags, split_sparse_features


def _feature(batch, max_len=4, vocab=1000):
    lengths = torch.randint(0, max_len + 1, (batch,))
    return torch.randint(0, vocab, (int(lengths.sum()),)), lengths


def test_seed_example():
    feats = [(torch.tensor([106, 211, 7]), torch.tensor([2, 1])),
             (torch.tensor([52, 498, 616, 870, 1013]), torch.tensor([3, 2])),
             (torch.tensor([2011, 19, 351, 790]), torch.tensor([1, 3]))]
    indices, lengths = combine_sparse_features(feats)
    assert indices.tolist() == [106, 211, 7, 52, 498, 616, 870, 1013, 2011, 19, 351, 790]
    assert lengths.tolist() == [2, 1, 3, 2, 1, 3]


@pytest.mark.parametrize("n,batch", [(1, 7), (13, 7), (100, 3)])
def test_split_inverts_combine(n, batch):
    feats = [_feature(batch) for _ in range(n)]
    indices, lengths = combine_sparse_features(feats)
    back = split_sparse_features(indices, lengths, n)
    assert len(back) == n
    for (i0, l0), (i1, l1) in zip(feats, back):
        assert torch.equal(i0, i1) and torch.equal(l0, l1)


def test_int32_lengths_and_empty_features():
    feats = [(torch.tensor([], dtype=torch.int64), torch.zeros(5, dtype=torch.int32)),
             (torch.arange(4), torch.tensor([1, 0, 3, 0, 0], dtype=torch.int32))]
    back = split_sparse_features(*combine_sparse_features(feats), 2)
    assert back[0][0].numel() == 0 and torch.equal(back[1][0], torch.arange(4))


@pytest.mark.parametrize("features,error,message", [
    ([], schedlang.ScheduleTypeError,
     r"^combine_sparse_features: expects a non-empty list of \(indices, lengths\) pairs, got \[\]$"),
    ([(torch.arange(3),)], schedlang.ScheduleTypeError,
     r"^combine_sparse_features: feature 0 must be a pair \(indices, lengths\) of tensors, got \(tensor"),
    ([(torch.arange(3), torch.ones(3, 1, dtype=torch.long))], schedlang.ScheduleValueError,
     r"^combine_sparse_features: feature 0 lengths must be a 1-D integer tensor, got shape \(3, 1\) of torch.int64$"),
    ([(torch.rand(3), torch.ones(3, dtype=torch.long))], schedlang.ScheduleValueError,
     r"^combine_sparse_features: feature 0 indices must be a 1-D integer tensor, got shape \(3,\) of torch.float32$"),
    ([(torch.arange(2), torch.ones(2, dtype=torch.long)), (torch.arange(3), torch.ones(3, dtype=torch.long))],
     schedlang.ScheduleValueError,
     r"^combine_sparse_features: feature 1 has 3 lengths but feature 0 has 2; every feature needs one length per "
     r"sample of the batch$"),
    ([(torch.arange(2), torch.ones(2, dtype=torch.long)), (torch.arange(2).int(), torch.ones(2, dtype=torch.long))],
     schedlang.ScheduleValueError,
     r"^combine_sparse_features: the indices tensors mix dtypes/devices \(torch.int32 on cpu, torch.int64 on cpu\); "
     r"they must share one; convert them first$"),
])
def test_bad_features(features, error, message):
    with pytest.raises(error, match=message):
        combine_sparse_features(features)


def test_split_refuses_lengths_that_do_not_divide():
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"^split_sparse_features: 7 lengths cannot be 2 features of one batch size; the "
                             r"number of lengths must be divisible by 2$"):
        split_sparse_features(torch.arange(3), torch.ones(7, dtype=torch.long), 2)


@pytest.mark.gpu
def test_pinned_output_and_device_split():
    feats = [_feature(9) for _ in range(5)]
    indices, lengths = combine_sparse_features(feats, pin_memory=True)
    assert indices.is_pinned() and lengths.is_pinned()
    back = split_sparse_features(indices.cuda(non_blocking=True), lengths.cuda(non_blocking=True), 5)
    for (i0, l0), (i1, l1) in zip(feats, back):
        assert torch.equal(i0, i1.cpu()) and torch.equal(l0, l1.cpu())


# --------------------------------------------------------------------------- the lazy split
def _eager_split(indices, lengths, n):
    """The split as it was made before it became lazy: every pair at once, sizes read on the host."""
    per_feature = lengths.view(n, -1)
    return tuple(zip(torch.split(indices, per_feature.sum(1).tolist()), per_feature.unbind(0)))


def _irregular_batch(n, batch, index_dtype, length_dtype, empty_features=(), seed=0):
    gen = torch.Generator().manual_seed(seed)
    feats = []
    for f in range(n):
        lengths = torch.randint(0, 4, (batch,), generator=gen)
        if batch > 2:
            lengths[int(torch.randint(0, batch, (1,), generator=gen))] = 0  # an empty sample somewhere
        if f in empty_features:
            lengths.zero_()
        indices = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
        feats.append((indices.to(index_dtype), lengths.to(length_dtype)))
    return feats


@pytest.mark.parametrize("index_dtype,length_dtype", [(torch.int64, torch.int64), (torch.int32, torch.int32),
                                                      (torch.int64, torch.int32)])
@pytest.mark.parametrize("n,batch", [(7, 13), (1, 1), (13, 7)])
def test_lazy_split_matches_the_eager_split(n, batch, index_dtype, length_dtype):
    feats = _irregular_batch(n, batch, index_dtype, length_dtype, empty_features={0, n // 2, n - 1})
    indices, lengths = combine_sparse_features(feats)
    split = split_sparse_features(indices, lengths, n)
    assert isinstance(split, SparseFeatureSplit) and isinstance(split, Sequence) and not split.materialized
    assert (split.num_features, split.batch_size, len(split)) == (n, batch, n)
    expected = _eager_split(indices, lengths, n)
    assert len(expected) == n
    for (a_idx, a_len), (e_idx, e_len), (f_idx, f_len) in zip(split, expected, feats):
        assert torch.equal(a_idx, e_idx) and torch.equal(a_len, e_len)
        assert torch.equal(a_idx, f_idx) and torch.equal(a_len, f_len)
        assert a_idx.dtype == index_dtype and a_len.dtype == length_dtype
        assert a_idx.untyped_storage().data_ptr() == indices.untyped_storage().data_ptr()  # views, not copies
    assert split.materialized
    assert torch.equal(split[-1][0], feats[-1][0]) and torch.equal(split[n - 1][1], feats[-1][1])
    assert [torch.equal(a, b) for (a, _), (b, _) in zip(split[1:3], feats[1:3])] == [True] * len(feats[1:3])
    (first_idx, first_len), *rest = split
    assert first_idx.numel() == 0 and len(rest) == n - 1
    with pytest.raises(IndexError):
        split[n]


@pytest.mark.parametrize("batch", [5, 0])
def test_combined_form_offsets(batch):
    feats = _irregular_batch(4, batch, torch.int32, torch.int64, empty_features={2})
    indices, lengths = combine_sparse_features(feats)
    split = split_sparse_features(indices, lengths, 4)
    flat = torch.cat([l for _, l in feats]).long()
    running = torch.cat([flat.new_zeros(1), flat.cumsum(0)])
    assert split.offsets.dtype == torch.int32 and torch.equal(split.offsets.long(), running)
    totals = torch.tensor([int(l.sum()) for _, l in feats])
    assert torch.equal(split.feature_lengths, totals)
    assert torch.equal(split.feature_offsets.long(), torch.cat([totals.new_zeros(1), totals.cumsum(0)]))
    assert split.lengths.shape == (4, batch) and split.indices is indices
    assert not split.materialized


def test_making_the_split_and_its_combined_form_never_waits_for_the_device(monkeypatch):
    feats = _irregular_batch(7, 13, torch.int64, torch.int64, empty_features={3})
    indices, lengths = combine_sparse_features(feats)
    weight = torch.randn(7 * 1000, 5)
    rows = torch.arange(7) * 1000

    def refuse(*args, **kwargs):
        raise AssertionError("device-to-host copy")

    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    split = split_sparse_features(indices, lengths, 7)
    split.offsets, split.feature_offsets, split.feature_lengths, repr(split), len(split)
    pooled = pooled_embedding_bags(split, weight, rows, "mean")
    with pytest.raises(AssertionError, match="device-to-host copy"):
        split[0]  # the pairs need the totals on the host
    monkeypatch.undo()
    assert not split.materialized and pooled.shape == (7, 13, 5)
    assert torch.equal(split[3][0], feats[3][0])


def _bags_one_by_one(feats, tables, mode):
    out = []
    for (idx, lens), table in zip(feats, tables):
        offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)[:-1]])
        out.append(F.embedding_bag(idx, table, offsets, mode=mode))
    return torch.stack(out)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_pooled_embedding_bags_matches_bags_one_by_one(mode, dtype):
    sizes = [3, 17, 1, 8, 30, 5, 11]
    gen = torch.Generator().manual_seed(1)
    feats = []
    for f, rows in enumerate(sizes):
        lens = torch.randint(0, 4, (13,), generator=gen)
        lens[f] = 0
        if f == 4:
            lens.zero_()
        feats.append((torch.randint(0, rows, (int(lens.sum()),), generator=gen).to(dtype), lens.to(dtype)))
    tables = [torch.randn(r, 6, requires_grad=True) for r in sizes]
    weight = torch.cat([t.detach() for t in tables]).requires_grad_()
    starts = torch.tensor([0] + sizes[:-1]).cumsum(0)
    split = split_sparse_features(*combine_sparse_features(feats), 7)
    got = pooled_embedding_bags(split, weight, starts, mode)
    expected = _bags_one_by_one(feats, tables, mode)
    torch.testing.assert_close(got, expected)
    grad = torch.randn(expected.shape, generator=gen)
    got.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(weight.grad, torch.cat([t.grad for t in tables]))


def test_pooled_embedding_bags_with_features_without_a_table():
    feats = _irregular_batch(3, 6, torch.int64, torch.int64)
    tables = [torch.randn(1000, 4), torch.randn(1000, 4)]
    split = split_sparse_features(*combine_sparse_features(feats), 3)
    got = pooled_embedding_bags(split, torch.cat(tables), torch.tensor([0, -1, 1000]), "sum", every_feature=False)
    expected = _bags_one_by_one([feats[0], feats[2]], tables, "sum")
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[2], expected[1])


@pytest.mark.parametrize("args,message", [
    ((torch.arange(3), torch.ones(3, dtype=torch.long), 0),
     r"^split_sparse_features: num_features must be an int >= 1, got 0$"),
    ((torch.arange(3), torch.ones(3, dtype=torch.long), 3.0),
     r"^split_sparse_features: num_features must be an int >= 1, got 3.0$"),
    ((torch.rand(3), torch.ones(3, dtype=torch.long), 3),
     r"^split_sparse_features: indices must be a 1-D integer tensor, got shape \(3,\) of torch.float32$"),
    ((torch.arange(3), torch.ones(3, 1, dtype=torch.long), 3),
     r"^split_sparse_features: lengths must be a 1-D integer tensor, got shape \(3, 1\) of torch.int64$"),
    ((torch.arange(3), [1, 1, 1], 3),
     r"^split_sparse_features: lengths must be a 1-D integer tensor, got \[1, 1, 1\]$"),
    ((torch.arange(3, device="meta"), torch.ones(3, dtype=torch.long), 3),
     r"^split_sparse_features: indices are on meta but lengths on cpu; both must be on one device$"),
])
def test_split_refuses_bad_arguments(args, message):
    with pytest.raises(schedlang.ScheduleValueError, match=message):
        split_sparse_features(*args)


def test_lengths_that_do_not_count_the_indices_are_reported_when_the_pairs_are_made():
    split = split_sparse_features(torch.arange(5), torch.tensor([1, 2, 0, 1]), 2)  # counts 3 + 1 = 4, not 5
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"^split_sparse_features: the lengths of the 2 features add up to 4 indices \(per "
                             r"feature: \[3, 1\]\), but indices has 5; the lengths must count the indices exactly, "
                             r"feature after feature$"):
        split[0]


@pytest.mark.parametrize("call,error,message", [
    (lambda s: pooled_embedding_bags((torch.arange(2),), torch.randn(4, 2), torch.zeros(1, dtype=torch.long)),
     schedlang.ScheduleTypeError,
     r"^pooled_embedding_bags: expects the SparseFeatureSplit of split_sparse_features, got \(tensor\(\[0, 1\]\),\)$"),
    (lambda s: pooled_embedding_bags(s, torch.randn(4, 2), torch.zeros(2, dtype=torch.long), "min"),
     schedlang.ScheduleValueError, r"^pooled_embedding_bags: mode must be 'sum', 'mean' or 'max', got 'min'$"),
    (lambda s: pooled_embedding_bags(s, torch.randn(4, 2), torch.zeros(3, dtype=torch.long)),
     schedlang.ScheduleValueError,
     r"^pooled_embedding_bags: row_offsets must be an integer tensor of shape \(2,\) \(one per feature\), got "
     r"shape \(3,\) of torch.int64$"),
])
def test_pooled_embedding_bags_refuses_bad_arguments(call, error, message):
    split = split_sparse_features(torch.arange(3), torch.tensor([1, 2, 0, 0]), 2)
    with pytest.raises(error, match=message):
        call(split)


@pytest.mark.gpu
def test_split_and_pooled_lookup_do_not_synchronize_on_the_gpu():
    feats = _irregular_batch(9, 13, torch.int64, torch.int64, empty_features={4})
    indices, lengths = combine_sparse_features(feats, pin_memory=True)
    weight = torch.randn(9 * 1000, 8, device="cuda")
    rows = (torch.arange(9) * 1000).cuda()
    d_idx, d_len = indices.cuda(non_blocking=True), lengths.cuda(non_blocking=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        split = split_sparse_features(d_idx, d_len, 9)
        pooled = pooled_embedding_bags(split, weight, rows, "sum")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = _bags_one_by_one(feats, weight.cpu().split(1000), "sum")
    torch.testing.assert_close(pooled.cpu(), expected)

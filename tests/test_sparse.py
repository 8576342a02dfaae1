import pytest
import torch

import schedlang
from schedlang.sparse import combine_sparse_features, split_sparse_features


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

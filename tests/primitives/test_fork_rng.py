import pytest
import torch
from torch import nn

import schedlang


class Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Dropout(0.5)
        self.b = nn.Dropout(0.5)

    def forward(self, x):
        return self.a(x), self.b(x)


def test_fork_rng_uses_a_separate_stream_and_leaves_default_stream_untouched():
    x = torch.ones(1000)
    torch.manual_seed(1)
    plain_a, plain_b = Drop()(x)
    sch = schedlang.create_schedule(Drop())
    sch["a"].fork_rng()
    torch.manual_seed(1)
    forked_a, forked_b = sch.mod(x)
    # the default stream is not consumed by the forked module, so b draws what a drew before
    assert torch.equal(forked_b, plain_a)
    assert not torch.equal(forked_a, plain_a)
    # the forked stream continues across calls and is reproducible
    torch.manual_seed(1)
    sch2 = schedlang.create_schedule(Drop())
    sch2["a"].fork_rng()
    again_a, _ = sch2.mod(x)
    assert torch.equal(again_a, forked_a)


def test_fork_rng_twice_rejected():
    sch = schedlang.create_schedule(Drop())
    sch["a"].fork_rng()
    with pytest.raises(schedlang.ScheduleValueError, match=r"^a: fork_rng was already applied here; fork the RNG of each module only once$"):
        sch["a"].fork_rng()


@pytest.mark.gpu
def test_fork_rng_on_cuda_and_on_cpu_of_a_gpu_machine():
    for device in ("cuda", "cpu"):
        x = torch.ones(1000, device=device)
        torch.manual_seed(1)
        plain_a, _ = Drop()(x)
        sch = schedlang.create_schedule(Drop())
        sch["a"].fork_rng()
        torch.manual_seed(1)
        forked_a, forked_b = sch.mod(x)
        assert torch.equal(forked_b, plain_a) and not torch.equal(forked_a, plain_a), device

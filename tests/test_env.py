import pytest

import schedlang
from schedlang.distributed.launch import run_distributed


def _setup_single(rank, world):
    # run_distributed already initialized a group: setup must leave it alone
    schedlang.env.setup(rank=rank, world_size=world, backend="gloo")
    return schedlang.create_schedule(__import__("torch").nn.Linear(4, 4)).world_size


def test_setup_is_a_no_op_when_initialized():
    assert run_distributed(_setup_single, world_size=2, timeout=60) == [2, 2]


def _fresh_process(rank, world):
    import torch.distributed as dist

    dist.destroy_process_group()
    import os

    os.environ.pop("MASTER_PORT", None)
    schedlang.env.setup(rank=0, world_size=1, backend="gloo")
    import torch

    total = torch.tensor([3.0])
    dist.all_reduce(total)
    # one process rendezvouses in memory: it claims no port that a process beside it could race for
    return dist.get_world_size(), dist.get_backend(), total.item(), "MASTER_PORT" in os.environ


def test_setup_single_process_like_slapo():
    assert run_distributed(_fresh_process, world_size=1, timeout=60) == [(1, "gloo", 3.0, False)]


@pytest.mark.parametrize("kwargs,message", [
    (dict(rank=2, world_size=2), "env.setup: rank 2 is not in range for world size 2"),
    (dict(backend="tcp"), "env.setup: unknown backend 'tcp': valid backends are nccl, gloo, mpi, ucc"),
])
def test_setup_errors(kwargs, message):
    with pytest.raises(schedlang.ScheduleValueError, match=message):
        schedlang.env.setup(**kwargs)

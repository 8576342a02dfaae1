"""A failure on one rank becomes an error on every rank, within seconds; plans are compared across ranks."""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import schedlang
from schedlang.distributed import groups
from schedlang.distributed.agreement import (PlanMismatchError, RankFailureError, agree, agreement, check_same_plan,
                                             exchange, plan_fingerprint)
from tests.helpers.distributed import run_distributed
from tests.helpers.models import MLP


def _megatron(sch):
    sch["fc1"].shard("weight", axis=0)
    sch["fc1"].shard("bias", axis=0)
    sch["fc2"].shard("weight", axis=1)
    sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")


def _outcome(fn):
    """(exception type name, message, cause type name) of calling fn, or ("ok", value, None)."""
    try:
        return "ok", fn(), None
    except Exception as e:
        return type(e).__name__, str(e), type(e.__cause__).__name__ if e.__cause__ is not None else None


# ----------------------------------------------------------------------------------- one process

def test_without_a_process_group_an_agreement_is_the_local_outcome():
    assert exchange(3, None, "local") == [3]
    agree(True, None, None, "local")
    with pytest.raises(KeyError, match="mine"):
        with agreement(None, phase="local"):
            raise KeyError("mine")
    check_same_plan(schedlang.create_schedule(MLP()).plan, None)


def test_plan_fingerprint_follows_the_steps():
    a, b = schedlang.create_schedule(MLP()), schedlang.create_schedule(MLP())
    assert plan_fingerprint(a.plan) == plan_fingerprint(b.plan)
    a["fc1"].shard("weight", axis=0)
    b["fc1"].shard("weight", axis=1)
    assert plan_fingerprint(a.plan) != plan_fingerprint(b.plan)
    assert plan_fingerprint(a) == plan_fingerprint(a.plan.to_json()) == plan_fingerprint(a.plan)
    assert plan_fingerprint("0123abcd") == "0123abcd"  # a hash is taken as it is
    with pytest.raises(schedlang.ScheduleValueError, match=r"check_same_plan: expected a Plan, a Schedule, a plan's "
                                                           r"JSON or a hash string, got int"):
        plan_fingerprint(3)


@pytest.mark.parametrize("value,message", [
    ("soon", r"\$SCHEDLANG_PG_TIMEOUT='soon' is not a number of seconds; set it to a positive number such as 120"),
    ("-4", r"process-group \$SCHEDLANG_PG_TIMEOUT must be a positive number of seconds, got -4.0"),
])
def test_pg_timeout_from_the_environment(monkeypatch, value, message):
    monkeypatch.setenv("SCHEDLANG_PG_TIMEOUT", "45")
    assert groups.pg_timeout().total_seconds() == 45 and groups.pg_timeout(7).total_seconds() == 7
    monkeypatch.delenv("SCHEDLANG_PG_TIMEOUT")
    assert groups.pg_timeout().total_seconds() == groups.DEFAULT_PG_TIMEOUT_S
    monkeypatch.setenv("SCHEDLANG_PG_TIMEOUT", value)
    with pytest.raises(schedlang.ScheduleValueError, match=message):
        groups.pg_timeout()
    with pytest.raises(schedlang.ScheduleValueError, match=r"process-group timeout must be a positive number of "
                                                           r"seconds, got 0"):
        groups.pg_timeout(0)


def test_grace_from_the_environment(monkeypatch):
    from schedlang.distributed.agreement import _grace

    monkeypatch.setenv("SCHEDLANG_AGREE_GRACE", "never")
    with pytest.raises(schedlang.ScheduleValueError, match=r"\$SCHEDLANG_AGREE_GRACE='never' is not a number of "
                                                           r"seconds; set it to a positive number such as 10"):
        _grace()


def test_run_distributed_rejects_a_bad_world_size():
    with pytest.raises(schedlang.ScheduleValueError, match=r"run_distributed: world_size must be a positive int, "
                                                           r"got 0"):
        run_distributed(_agreements, world_size=0)


# ----------------------------------------------------------------------------------- two ranks

class FailsOnRank(nn.Module):
    """Identity, except that its forward raises on one rank (as a rank-dependent bug would)."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def forward(self, x):
        if dist.get_rank() == self.rank:
            raise ValueError(f"boom on rank {self.rank}")
        return x


def _agreements(rank, world):
    found = {}
    found["exchange"] = exchange({"rank": rank}, None, "exchange")
    # every rank raises: each keeps its own error (a deterministic bad argument reads as in one process)
    found["all_fail"] = _outcome(lambda: agree(False, ValueError(f"bad value on {rank}"), None, "all fail"))
    # one rank raises, nobody is blocked: everyone raises RankFailureError naming it; the group stays usable
    def one_fails():
        with agreement(None, phase="one fails"):
            if rank == 1:
                raise KeyError("missing 'fc3'")
    found["one_fails"] = _outcome(one_fails)
    t = torch.ones(3) * (rank + 1)
    dist.all_reduce(t)
    found["still_usable"] = t.tolist()
    # plans: the same plan passes, a different one names the first differing step on every rank
    sch = schedlang.create_schedule(MLP(hidden=10, inner=14))
    sch["fc1"].shard("weight", axis=0)
    check_same_plan(sch.plan, None)
    sch["fc2"].shard("weight", axis=1 if rank == 0 else 0)
    sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    found["plan_differs"] = _outcome(lambda: check_same_plan(sch.plan, None, phase="build: plan comparison"))
    longer = schedlang.create_schedule(MLP(hidden=10, inner=14))
    longer["fc1"].shard("weight", axis=0)
    if rank == 1:
        longer["fc1"].shard("bias", axis=0)
    found["plan_longer"] = _outcome(lambda: check_same_plan(longer.plan.to_json(), None))
    # build compares plans before it runs anything
    found["build"] = _outcome(lambda: schedlang.build(sch))
    return found


def test_agreements_on_two_ranks():
    results = run_distributed(_agreements, world_size=2, timeout=120)
    for rank, found in enumerate(results):
        assert found["exchange"] == [{"rank": 0}, {"rank": 1}]
        assert found["all_fail"] == ("ValueError", f"bad value on {rank}", None)
        kind, message, cause = found["one_fails"]
        assert kind == "RankFailureError"
        assert message.startswith("rank 1 failed during 'one fails': KeyError: \"missing 'fc3'\" (at test_agreement.py:")
        assert cause == ("KeyError" if rank == 1 else None)
        assert found["still_usable"] == [3.0, 3.0, 3.0]
        kind, message, _ = found["plan_differs"]
        assert kind == "PlanMismatchError"
        assert message.startswith("build: plan comparison: the plans differ between ranks (hash ")
        assert ("first differs at step [1]: rank 0 has shard at 'fc2' (tensor_name='weight', axis=1), rank 1 has "
                "shard at 'fc2' (tensor_name='weight', axis=0)") in message
        assert "every rank must apply the same primitives in the same order" in message
        kind, message, _ = found["plan_longer"]
        assert kind == "PlanMismatchError"
        assert "has 2 steps, rank 0 1: rank 1's step [1] (shard at 'fc1' ({\"axis\": 0, \"tensor_name\": \"bias\"})) " \
               "is missing on rank 0" in message
        assert found["build"][0] == "PlanMismatchError" and "step [1]" in found["build"][1]


def _fails_inside_verify(rank, world):
    torch.manual_seed(0)
    model = MLP(hidden=10, inner=14)
    model.act = nn.Sequential(nn.GELU(), FailsOnRank(1))
    sch = schedlang.create_schedule(model)
    start = time.monotonic()
    try:
        # rank 1 raises in the original model's forward; rank 0 goes on into the scheduled model's all-reduce,
        # which rank 1 never joins
        with schedlang.Verify(sch, example_inputs=[torch.randn(4, 10)]):
            _megatron(sch)
    except RankFailureError as e:
        return str(e), time.monotonic() - start, dist.is_initialized()
    return None, time.monotonic() - start, dist.is_initialized()


def test_a_rank_raising_inside_verify_fails_every_rank_within_seconds(monkeypatch):
    monkeypatch.setenv("SCHEDLANG_AGREE_GRACE", "2")
    collective_timeout = 100
    results = run_distributed(_fails_inside_verify, world_size=2, timeout=150, collective_timeout=collective_timeout)
    for rank, (message, seconds, still_initialized) in enumerate(results):
        assert message is not None, f"rank {rank} did not raise"
        # rank 1's original model rejects the example inputs: Verify says so, and every rank hears it
        assert message.startswith("rank 1 failed during 'verify: running the original and the scheduled model': "
                                  "ExampleInputError: Verify: the original model itself fails on the example inputs "
                                  "(eval mode): ValueError: boom on rank 1"), message
        assert "rank 1 waited 2 s for rank 0 (blocked in a collective, or slower), then destroyed its process " \
               "groups" in message
        # released by rank 1 giving up, not by the group timeout
        assert seconds < collective_timeout / 2, (rank, seconds)
        assert not still_initialized  # after a rank gave up the groups are destroyed everywhere
    assert "then rank 0 raised RuntimeError" in results[0][0]


def _skips_a_collective(rank, world):
    start = time.monotonic()
    try:
        with agreement(None, phase="all-reduce of the loss"):
            if rank == 0:  # rank 1 skips the collective
                dist.all_reduce(torch.ones(2))
    except RankFailureError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


def test_a_rank_skipping_a_collective_fails_within_the_group_timeout(monkeypatch):
    monkeypatch.setenv("SCHEDLANG_AGREE_GRACE", "2")
    results = run_distributed(_skips_a_collective, world_size=2, timeout=90, collective_timeout=10)
    for rank, (message, seconds) in enumerate(results):
        assert message is not None, f"rank {rank} did not raise"
        assert message.startswith("rank 0 failed during 'all-reduce of the loss': "), message
        assert "timed out" in message.lower() or "timeout" in message.lower(), message
        assert seconds < 60, (rank, seconds)


def _raises(rank, world):
    if rank == 1:
        raise ZeroDivisionError("rank 1 divides by zero")
    time.sleep(60)  # rank 0 is still working: the launcher stops it


def test_the_launcher_names_the_rank_that_failed_first_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(schedlang.DistributedError) as info:
        run_distributed(_raises, world_size=2, timeout=120, failure_grace=1)
    message = str(info.value)
    assert message.startswith("run_distributed: distributed run of _raises on 2 ranks (gloo) failed:\n"
                              "rank 1 failed first (ZeroDivisionError: rank 1 divides by zero)\n")
    # rank 0, asleep, is stopped by the launcher; on a loaded machine its own side can notice the lost peer first
    # (a gloo connection error) and fail after rank 1 within the grace, which the message names as a failure
    assert ("rank(s) [0] did not finish within 120 s (stopped 1 s after rank 1 failed)" in message
            or "\nrank 0 failed:\n" in message), message
    assert time.monotonic() - start < 60


def _make_mesh_timeouts(rank, world):
    from schedlang.distributed.mesh import make_mesh

    mesh = make_mesh(dp=1, tp=2, device_type="cpu", timeout=17)
    backend = mesh.get_group(mesh.mesh_dim_names.index("tp"))._get_backend(torch.device("cpu"))
    options = getattr(backend, "options", None)
    return None if options is None else options._timeout.total_seconds()


def test_make_mesh_gives_every_dimension_a_finite_timeout():
    timeouts = run_distributed(_make_mesh_timeouts, world_size=2, timeout=90)
    for seconds in timeouts:
        if seconds is not None:  # backends that expose their options
            assert seconds == 17


# ----------------------------------------------------------------------------------- GPUs

def _nccl_tp(rank, world):
    torch.manual_seed(0)
    device = torch.device("cuda", rank)
    sch = schedlang.create_schedule(MLP(hidden=16, inner=32).to(device))
    with schedlang.Verify(sch, example_inputs=[torch.randn(4, 16, device=device)]):
        _megatron(sch)
    model, opt = schedlang.build(sch, optimizer="adamw", lr=1e-3)
    model(torch.randn(3, 16, device=device)).sum().backward()
    opt.step()
    cpu = torch.ones(2) * (rank + 1)  # CPU tensors use the group's gloo part
    dist.all_reduce(cpu)
    cuda = torch.ones(2, device=device) * (rank + 1)
    dist.all_reduce(cuda)
    found = _outcome(lambda: agree(rank == 0, None if rank == 0 else ValueError("cuda rank 1"), None, "nccl phase"))
    return str(dist.get_backend()), cpu.tolist(), cuda.cpu().tolist(), found[0], found[1]


@pytest.mark.multigpu(2)
def test_nccl_and_gloo_in_one_group_with_agreement():
    for backend, cpu, cuda, kind, message in run_distributed(_nccl_tp, world_size=2, timeout=240):
        assert "nccl" in backend and "gloo" in backend
        assert cpu == cuda == [3.0, 3.0]
        assert kind == "RankFailureError" and message.startswith("rank 1 failed during 'nccl phase': ValueError")

"""Verify called Slapo's way: one tensor as example_inputs, device=, eval_mode=, a model on the meta device."""

import pytest
import torch
from torch import nn

import schedlang as slapo
from schedlang.errors import ScheduleTypeError, ScheduleValueError
from tests.helpers.distributed import run_distributed


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 20)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(20, 7)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def test_one_tensor_is_the_example_input():
    sch = slapo.create_schedule(Block())
    with slapo.Verify(sch, torch.randn(5, 12)) as check:
        sch["fc1"].decompose()
    assert check.report.passed and check.report.compared


def test_a_wrong_step_is_still_caught_with_one_tensor():
    sch = slapo.create_schedule(Block())
    wrong = nn.Linear(20, 7)
    with pytest.raises(slapo.VerificationError):
        with slapo.Verify(sch, torch.randn(5, 12)):
            sch["fc2"].replace(wrong)
    assert len(sch.plan) == 0


def test_eval_mode_true_compares_in_eval_mode_only():
    sch = slapo.create_schedule(Block())
    with slapo.Verify(sch, [torch.randn(5, 12)], eval_mode=True) as check:
        sch["fc1"].decompose()
    with slapo.Verify(sch, [torch.randn(5, 12)], eval_mode=False) as both:
        sch["fc2"].decompose()
    # the training pass doubles what is compared
    assert len(both.report.compared) > len(check.report.compared)


def test_device_moves_the_inputs_and_the_models():
    sch = slapo.create_schedule(Block())
    with slapo.Verify(sch, [torch.randn(5, 12)], device="cpu") as check:
        sch["fc1"].decompose()
    assert check.report.passed


def test_a_meta_device_model_is_verified_on_materialized_weights():
    with slapo.init_empty_weights():
        model = Block()
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, [torch.randn(5, 12)], eval_mode=True) as check:
        sch["fc1"].decompose()
    assert check.report.passed
    assert all(p.is_meta for p in sch.mod.parameters())  # the schedule's model stays on the meta device
    with pytest.raises(slapo.VerificationError):
        with slapo.Verify(sch, [torch.randn(5, 12)], eval_mode=True):
            sch["fc2"].replace(nn.Linear(20, 7, device="meta"))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(device=3.5), ScheduleTypeError,
     r"^Verify: device must be a string such as 'cpu' or 'cuda:0', a torch\.device or a GPU index, got 3\.5$"),
    (dict(device="gpu9"), ScheduleValueError, r"^Verify: device 'gpu9' is not a device: valid are 'cpu', 'cuda'"),
    (dict(device="meta"), ScheduleValueError, r"^Verify: device 'meta' cannot run the models: use 'cpu' or 'cuda'$"),
    (dict(eval_mode="yes"), ScheduleTypeError,
     r"^Verify: eval_mode must be True \(compare in eval mode only, Slapo's default\) or False \(also in training "
     r"mode\), got 'yes'$"),
])
def test_argument_errors(kwargs, error, message):
    sch = slapo.create_schedule(Block())
    with pytest.raises(error, match=message):
        slapo.Verify(sch, torch.randn(5, 12), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused():
    sch = slapo.create_schedule(Block())
    with pytest.raises(ScheduleValueError, match=r"^Verify: device 'cuda:0' asks for CUDA, but no CUDA device is "):
        slapo.Verify(sch, torch.randn(5, 12), device="cuda:0")


def _meta_tensor_parallel(rank, world):
    torch.manual_seed(0)
    with slapo.init_empty_weights():
        model = nn.Sequential(nn.Linear(10, 14), nn.ReLU(), nn.Linear(14, 6))
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, [torch.randn(4, 10)], device="cpu", eval_mode=True):
        sch["0"].shard("weight", axis=0)
        sch["0"].shard("bias", axis=0)
        sch["0"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        sch["2"].shard("weight", axis=1)
        sch["2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    fresh = slapo.create_schedule(model)
    caught = False
    try:
        with slapo.Verify(fresh, [torch.randn(4, 10)], device="cpu", eval_mode=True):
            fresh["0"].shard("weight", axis=0)
            fresh["0"].shard("bias", axis=0)
            fresh["2"].shard("weight", axis=1)  # no all-reduce of the partial sums
    except slapo.VerificationError:
        caught = True
    return {"steps": len(sch.plan), "caught": caught, "fresh_steps": len(fresh.plan)}


def test_meta_model_tensor_parallel_on_two_ranks():
    results = run_distributed(_meta_tensor_parallel, world_size=2)
    assert results == [{"steps": 5, "caught": True, "fresh_steps": 0}] * 2

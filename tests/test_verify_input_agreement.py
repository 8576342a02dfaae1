"""Example inputs of different shapes or dtypes on different ranks: every rank raises, nothing aborts.

Verify broadcasts rank 0's weights and inputs. Tensors of different sizes in one gloo broadcast
abort the process (a C++ enforce: "Received data size doesn't match expected size"). The ranks
first agree on what they pass, through the job's store, and on a mismatch each raises
``ExampleInputMismatchError`` naming the ranks and the shapes, within seconds.
"""

import time

import pytest
import torch
from torch import nn

import schedlang
from schedlang.verify import ExampleInputMismatchError
from schedlang.verify.input_agreement import describe_value
from tests.helpers.distributed import run_distributed


class MLP(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _tensor_parallel_mlp(sch):
    sch["fc1"].shard("weight", axis=0)
    sch["fc1"].shard("bias", axis=0)
    sch["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["fc2"].shard("weight", axis=1)
    sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")


def _verify(sch, *args, **kwargs):
    """``{"error": (type name, message), "seconds": ...}`` of one Verify block, with the plan's length after it."""
    start = time.monotonic()
    out = {}
    try:
        with schedlang.Verify(sch, example_inputs=list(args), example_kwargs=kwargs or None):
            _tensor_parallel_mlp(sch)
    except Exception as e:  # reported to the test
        out["error"] = (type(e).__name__, str(e), isinstance(e, schedlang.SchedlangError), isinstance(e, ValueError))
    out["seconds"] = time.monotonic() - start
    out["steps"] = len(sch.plan)
    return out


def _world2(rank, world):
    torch.manual_seed(0)
    model = MLP()
    results = {}
    # a user slicing the data per rank: rank 1 gets 3 rows, rank 0 gets 4
    results["rows"] = _verify(schedlang.create_schedule(model), torch.randn(4 - rank, 8))
    # the same shape in another dtype, as a keyword (found before the model would run on it)
    dtype = torch.float32 if rank == 0 else torch.float64
    results["dtype"] = _verify(schedlang.create_schedule(model), torch.randn(4, 8), scale=torch.ones(1, dtype=dtype))
    # a model built with another width on one rank
    results["model"] = _verify(schedlang.create_schedule(MLP(16 if rank == 0 else 24)), torch.randn(4, 8))
    # the values may differ (rank 0's are used): this passes, and the process group still works afterwards
    results["values"] = _verify(schedlang.create_schedule(model), torch.randn(4, 8) + rank)
    both = torch.tensor([float(rank)])
    torch.distributed.all_reduce(both)
    results["all_reduce_after"] = float(both)
    return results


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2, world_size=2, timeout=240)


def test_inputs_of_different_shapes_raise_on_every_rank_naming_ranks_and_shapes(world2):
    for r in world2:
        name, message, schedlang_error, value_error = r["rows"]["error"]
        assert name == "ExampleInputMismatchError" and schedlang_error and value_error
        assert message.splitlines()[:2] == [
            "Verify: the example inputs differ across ranks:",
            "  input[0]: rank 0: tensor (4, 8) float32; rank 1: tensor (3, 8) float32"], message
        assert "every rank must pass example inputs of the same shapes and dtypes" in message
        # raised by the agreement, not by a collective timing out (120 s): far below that even on a loaded machine
        assert r["rows"]["seconds"] < 90, r["rows"]
        assert r["rows"]["steps"] == 0  # the block is undone


def test_a_keyword_input_of_another_dtype_is_named(world2):
    for r in world2:
        message = r["dtype"]["error"][1]
        assert "  input 'scale': rank 0: tensor (1,) float32; rank 1: tensor (1,) float64" in message, message


def test_a_model_of_other_shapes_on_one_rank_is_named(world2):
    for r in world2:
        name, message = r["model"]["error"][:2]
        assert name == "ExampleInputMismatchError"
        assert message.startswith("Verify: the original model's tensors differ across ranks:\n"), message
        assert "  parameter or buffer 'fc1.weight': rank 0: tensor (16, 8) float32; rank 1: tensor (24, 8) float32" \
            in message, message


def test_inputs_with_other_values_but_the_same_shapes_pass_and_the_group_stays_usable(world2):
    for r in world2:
        assert "error" not in r["values"], r["values"]
        assert r["values"]["steps"] == 5
        assert r["all_reduce_after"] == 1.0


def test_descriptions_name_shape_dtype_and_plain_values():
    assert describe_value(torch.zeros(2, 3, dtype=torch.int64)) == "tensor (2, 3) int64"
    assert describe_value(None) == "NoneType None"
    assert describe_value(True) == "bool True"
    assert describe_value("x" * 100) == "str '" + "x" * 56 + "..."
    assert describe_value([1, 2]) == "list"

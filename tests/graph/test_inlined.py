"""schedlang.graph.inlined: modules whose forward a traced ancestor inlined, and the primitives refused on them."""

import pytest
import torch
from torch import nn

import schedlang
from schedlang.graph.inlined import Inlined, inlined_by_trace


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 10)
        self.b = nn.Linear(10, 6)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.head = nn.Linear(6, 3)
        self.spare = nn.Linear(6, 6)  # never used by forward

    def forward(self, x):
        return self.head(self.inner(x))


class Top(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x)


def _flattened():
    sch = schedlang.create_schedule(Top())
    sch["block"].trace(flatten=True)
    return sch


def test_a_flattened_container_and_an_unused_module_are_inlined_and_the_leaves_run():
    sch = _flattened()
    assert inlined_by_trace(sch.mod, "block.inner") == Inlined(traced="block", calls=["inner.a", "inner.b"])
    assert inlined_by_trace(sch.mod, "block.spare") == Inlined(traced="block", calls=[])
    for running in ("", "block", "block.inner.a", "block.inner.b", "block.head"):
        assert inlined_by_trace(sch.mod, running) is None, running


def test_a_trace_that_keeps_the_hierarchy_inlines_nothing():
    sch = schedlang.create_schedule(Top())
    sch["block"].trace()
    for path in ("block.inner", "block.inner.a", "block.head"):
        assert inlined_by_trace(sch.mod, path) is None, path


@pytest.mark.parametrize("apply", [
    lambda s: s.sync("fwd_post", "all_reduce"),
    lambda s: s.checkpoint(),
    lambda s: s.replace(nn.Identity()),
    lambda s: s.trace(),
], ids=["sync", "checkpoint", "replace", "trace"])
def test_primitives_through_the_forward_of_an_inlined_container_are_refused(apply):
    sch = _flattened()
    x = torch.randn(4, 6)
    before = sch.mod(x)
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"block\.inner: \w+ needs this module's forward to run, and it never does: the graph "
                             r"traced at block .* calls block\.inner\.a, block\.inner\.b inside it directly"):
        apply(sch["block.inner"])
    assert len(sch.plan) == 1  # the trace alone
    torch.testing.assert_close(sch.mod(x), before)


def test_an_unused_module_is_refused_with_what_its_graph_does():
    sch = _flattened()
    with pytest.raises(schedlang.ScheduleValueError, match=r"block\.spare: sync .* uses nothing inside it"):
        sch["block.spare"].sync("fwd_post", "all_reduce")


def test_the_leaves_the_graph_calls_and_tensor_primitives_still_apply():
    sch = _flattened()
    x = torch.randn(4, 6)
    expected = sch.mod(x)
    sch["block.inner.a"].shard("weight", axis=0)  # world of one: the whole tensor
    sch["block.inner.a"].sync("fwd_post", "all_reduce")
    sch["block.inner.a"].checkpoint()
    torch.testing.assert_close(sch.mod(x), expected)
    assert [step.primitive for step in sch.plan] == ["trace", "shard", "sync", "checkpoint"]

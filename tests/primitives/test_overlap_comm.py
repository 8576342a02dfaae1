"""``Schedule.overlap_communication`` on one process: where starts and waits go, what is left alone."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import schedlang
from schedlang.distributed.sync_ops import SyncOp
from tests.helpers.models import MLP


class _SyncLeaf(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, SyncOp) or super().is_leaf_module(m, qualname)


def _traced(module):
    return fx.GraphModule(module, _SyncLeaf().trace(module))


class Branches(nn.Module):
    """The all-reduced branch is computed first, the independent one after it."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(6, 4))
        self.w2 = nn.Parameter(torch.randn(6, 4))
        self.sync = SyncOp("fwd_post", "all_reduce")
        self.user = SyncOp("fwd_post", lambda t: t * 2)
        self.later = SyncOp("bwd_post", "all_reduce")

    def forward(self, x, y):
        h = F.linear(x, self.w1)
        side = torch.tanh(F.linear(y, self.w2))  # written before the collective: the start is hoisted above it
        r = self.sync(h)
        more = torch.sigmoid(side) * 3  # written after: pulled up before the wait
        return self.later(self.user(r + more))


def _order(gm):
    return [n.name for n in gm.graph.nodes]


def test_start_goes_up_and_wait_goes_down_past_independent_work():
    model = Branches()
    sch = schedlang.create_schedule(_traced(model))
    report = sch._run("overlap_communication")
    order = _order(sch.mod)
    start, wait = order.index("start_sync"), order.index("wait_sync")
    assert order.index("linear") < start < order.index("linear_1") < order.index("tanh") < order.index("mul") < wait
    assert str(report) == (
        "overlap_communication at '<root>': 1 collective(s) made asynchronous\n"
        "  all_reduce 'sync': start_sync ... wait_sync, 4 node(s) in between\n"
        "  left as is: 'user': a user function, which cannot be made asynchronous\n"
        "  left as is: 'later' (bwd_post, op all_reduce): nothing to start early in forward")
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(sch.mod(x, y), model(x, y))  # one rank: the collectives are identities
    assert sch.plan[-1].args == {"hoist": True}


def test_without_hoisting_the_start_stays_where_the_call_was():
    sch = schedlang.create_schedule(_traced(Branches()))
    sch._run("overlap_communication", hoist=False)
    order = _order(sch.mod)
    assert order.index("tanh") < order.index("start_sync") < order.index("sigmoid") < order.index("wait_sync")


class RandomAfter(nn.Module):
    def __init__(self):
        super().__init__()
        self.sync = SyncOp("fwd_post", "all_reduce")
        self.drop = nn.Dropout(0.5)

    def forward(self, x, y):
        r = self.sync(x * 2) + 1
        a = torch.tanh(y)
        d = self.drop(y)  # random numbers keep their place in the program
        b = torch.sigmoid(y)
        return r + a + d + b


def test_independent_work_is_not_pulled_past_random_ops():
    sch = schedlang.create_schedule(_traced(RandomAfter()))
    sch._run("overlap_communication")
    order = _order(sch.mod)
    assert order.index("tanh") < order.index("wait_sync") < order.index("drop") < order.index("sigmoid")


def test_sync_hooks_of_leaf_modules_become_graph_nodes():
    model = MLP(7, 13)
    sch = schedlang.create_schedule(model)
    sch["fc2"].sync("fwd_post", "all_reduce")
    sch["fc1"].sync("fwd_pre", "all_gather", axis=0)
    sch._set_module(fx.symbolic_trace(sch.mod))  # leaf Linear modules keep their sync hooks
    report = sch._run("overlap_communication")
    assert [(r.kind, r.node) for r in report.records] == [("all_gather", "fc1__schedlang_sync_fwd_pre_0"),
                                                          ("all_reduce", "fc2__schedlang_sync_fwd_post_0")]
    assert not sch["fc2"].mod._forward_hooks and not sch["fc1"].mod._forward_pre_hooks
    x = torch.randn(5, 7)
    torch.testing.assert_close(sch.mod(x), model(x))


def test_nothing_to_overlap():
    sch = schedlang.create_schedule(fx.symbolic_trace(MLP()))
    report = sch._run("overlap_communication")
    assert len(report) == 0 and str(report) == "overlap_communication at '<root>': 0 collective(s) made asynchronous"


def test_errors():
    sch = schedlang.create_schedule(MLP())
    with pytest.raises(schedlang.NotTracedError, match=r"^fc1: overlap_communication needs a traced module, but "
                                                       r"this is Linear; call sch\[\"fc1\"\]\.trace\(\) first$"):
        sch["fc1"]._run("overlap_communication")
    sch = schedlang.create_schedule(fx.symbolic_trace(MLP()))
    with pytest.raises(schedlang.ScheduleTypeError,
                       match=r"^<root>: overlap_communication hoist must be True or False, got 'yes'$"):
        sch._run("overlap_communication", hoist="yes")
    assert len(sch.plan) == 0

"""``Schedule.find``: a query on the traced module, never a plan step."""

import pytest
import torch
import torch.nn.functional as F

import schedlang
from schedlang.errors import NotTracedError, PatternError, ScheduleTypeError
from tests.helpers.models import MLP, Stack


def test_find_by_regex_and_by_pattern_without_recording_a_step():
    sch = schedlang.create_schedule(Stack())
    sch.trace()
    nodes = sch.find(r"fc\d")
    assert [(p, n.target) for p, n in nodes] == [("layers.0.mlp", "fc1"), ("layers.0.mlp", "fc2"),
                                                ("layers.1.mlp", "fc1"), ("layers.1.mlp", "fc2")]
    sub = sch["layers.1"].find(lambda x: F.gelu(x))
    assert [[(p, n.name) for p, n in sg] for sg in sub] == [[("mlp", "act")]]
    assert len(sch.plan) == 1  # only the trace


def test_slapo_tutorial_result_shape():
    model = MLP(hidden=16, inner=16)
    sch = schedlang.create_schedule(model)
    sch["fc1"].decompose()
    sch.trace(flatten=True)
    subgraph = sch.find(lambda x, bias: F.gelu(bias + x))
    assert [[(p, n.name) for p, n in sg] for sg in subgraph] == [[("", "add"), ("", "act")]]
    assert sch.find(lambda x: torch.tanh(x)) == []


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else x


def test_find_errors():
    # find traces an untraced module itself (as Slapo does); only a tracing failure is an error
    broken = schedlang.create_schedule(torch.nn.Sequential(_DataDependent()))
    with pytest.raises(NotTracedError, match=r"^<root>: find needs a traced module, and tracing this Sequential on "
                                             r"demand \(trace\(\) with its defaults\) failed: .*used as a condition.*; "
                                             r"call sch\.trace\(\.\.\.\) with leaf_modules= or concrete_args= first$"):
        broken.find("fc")
    with pytest.raises(NotTracedError, match=r"^0: find needs a traced module, and tracing this _DataDependent on "
                                             r"demand .*; call sch\[\"0\"\]\.trace\(\.\.\.\) with"):
        broken["0"].find(lambda x: F.gelu(x))
    assert len(broken.plan) == 0 and not isinstance(broken.mod, torch.fx.GraphModule)
    sch = schedlang.create_schedule(Stack())
    sch.trace()
    with pytest.raises(PatternError, match=r"^<root>: find got an invalid regex '\(fc': "):
        sch.find("(fc")
    with pytest.raises(ScheduleTypeError, match=r"^<root>: find expects a regex string, a pattern function or an "
                                                r"nn.Module, got int$"):
        sch.find(3)
    with pytest.raises(PatternError, match=r"^<root>: cannot trace pattern broken: ValueError: no"):
        def broken(x):
            raise ValueError("no")

        sch.find(broken)
    with pytest.raises(PatternError, match=r"^layers\.0: pattern <lambda> must return results of operations, but "
                                           r"returns x directly; pass a regex, or a function FX can trace$"):
        sch["layers.0"].find(lambda x: x)

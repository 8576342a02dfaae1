"""ForwardMark: a context variable set for the duration of each call of one model, and only then."""

import contextvars
import copy
import pickle

import pytest
import torch
from torch import nn

from schedlang.models.forward_marks import ForwardMark

SEEN = contextvars.ContextVar("test_forward_marks_seen", default="unset")


class Described(ForwardMark):
    variable = SEEN

    def value(self, args, kwargs):
        return f"{len(args)} args, scale={kwargs.get('scale')}"


class Reader(nn.Module):
    def __init__(self, inner=None):
        super().__init__()
        self.inner = inner
        self.seen = []

    def forward(self, x, scale=None):
        self.seen.append(SEEN.get())
        if self.inner is not None:
            self.inner(x)
            self.seen.append(SEEN.get())  # back to this call's value after the inner one
        if scale == "raise":
            raise ValueError("planted")
        return x


def test_the_mark_holds_during_each_call_nested_ones_unwind_and_a_raise_resets_it():
    inner = Reader()
    outer = Reader(inner)
    Described().install(outer)
    Described().install(inner)
    outer(torch.ones(1), scale=2)
    assert outer.seen == ["1 args, scale=2", "1 args, scale=2"] and inner.seen == ["1 args, scale=None"]
    assert SEEN.get() == "unset"
    with pytest.raises(ValueError, match="planted"):
        outer(torch.ones(1), scale="raise")
    assert SEEN.get() == "unset"
    Reader()(torch.ones(1))  # an unmarked model sees nothing
    assert SEEN.get() == "unset"


def test_a_marked_model_can_be_copied_and_pickled():
    model = Reader()
    Described().install(model)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        twin.seen.clear()
        twin(torch.ones(1))
        assert twin.seen == ["1 args, scale=None"]


def test_a_call_traced_by_torch_compile_leaves_the_mark_alone():
    class Plain(nn.Module):
        def forward(self, x):
            return x * 2

    model = Plain()
    mark = Described()
    mark.install(model)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert SEEN.get() == "unset" and mark.tokens == []

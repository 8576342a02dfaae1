"""Subgraph checks, extraction and the plan encoding."""

import json

import pytest
import torch
from torch import nn

import schedlang
from schedlang.errors import NotTracedError, PatternError, ScheduleTypeError, ScheduleValueError
from schedlang.graph import decode_subgraphs, encode_subgraphs, extract_subgraph, validate_subgraphs


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        a = torch.tanh(x)
        b = torch.sigmoid(a)        # outside {a, c}, between them
        c = a * b
        return self.norm(self.fc(c)) + c


def _traced(model=None, flatten=False):
    sch = schedlang.create_schedule(model or _Net())
    sch.trace(flatten=flatten)
    return sch


def _node(sch, name, path=""):
    return next(n for n in sch[path].mod.graph.nodes if n.name == name) if path else \
        next(n for n in sch.mod.graph.nodes if n.name == name)


def test_structures_accepted_and_normalized():
    sch = _traced()
    tanh, mul = _node(sch, "tanh"), _node(sch, "mul")
    sig = _node(sch, "sigmoid")
    one_pair = validate_subgraphs(sch, ("", tanh), "fuse")
    flat = validate_subgraphs(sch, [("", sig), ("", tanh)], "fuse")   # one subgraph, put in graph order
    nested = validate_subgraphs(sch, [[("", tanh)], [("", mul)]], "fuse")
    assert one_pair == [[("", tanh)]]
    assert flat == [[("", tanh), ("", sig)]]
    assert nested == [[("", tanh)], [("", mul)]]
    by_name = validate_subgraphs(sch, [["", "tanh"], ["", "sigmoid"]], "fuse")
    assert by_name == flat


def test_encoding_round_trips_through_json_and_resolves_on_another_graph():
    sch = _traced()
    found = sch.find(lambda x: torch.tanh(x))
    data = json.loads(json.dumps(encode_subgraphs(found)))
    assert data == [[["", "tanh"]]]
    decoded = decode_subgraphs(data)
    assert decoded == [[("", "tanh")]]
    other = _traced()
    resolved = validate_subgraphs(other, decoded, "fuse")
    assert resolved[0][0][1].graph is other.mod.graph
    # node objects of another graph resolve by name as well
    assert validate_subgraphs(other, found, "fuse")[0][0][1] is resolved[0][0][1]


def test_errors_before_anything_changes():
    plain = schedlang.create_schedule(_Net())
    with pytest.raises(NotTracedError, match=r"^<root>: fuse needs a traced module, but this is _Net; call "
                                             r"sch\.trace\(\) first$"):
        validate_subgraphs(plain, [("", "tanh")], "fuse")
    sch = _traced()
    with pytest.raises(PatternError, match=r"^<root>: fuse got an empty list of subgraphs \(did find\(\) match "
                                           r"nothing\?\)$"):
        validate_subgraphs(sch, [], "fuse")
    with pytest.raises(ScheduleTypeError, match=r"^<root>: replace expects subgraphs as find\(\) returns them: a list "
                                                r"of \(path, node\) pairs, or a list of such lists; got \['tanh'\]$"):
        validate_subgraphs(sch, ["tanh"], "replace")
    with pytest.raises(ScheduleValueError, match=r"^<root>: no node named 'nope' in the graph of '<root>' \(was it "
                                                 r"removed by an earlier fuse or replace\? call find\(\) again\)$"):
        validate_subgraphs(sch, [("", "nope")], "fuse")
    with pytest.raises(ScheduleValueError, match=r"^<root>: a subgraph names module path 'ghost', which does not "
                                                 r"exist under this schedule"):
        validate_subgraphs(sch, [("ghost", "tanh")], "fuse")
    with pytest.raises(ScheduleValueError, match=r"^<root>: node 'tanh' is in subgraphs 0 and 1; subgraphs must not "
                                                 r"overlap$"):
        validate_subgraphs(sch, [[("", "tanh")], [("", "tanh"), ("", "mul")]], "fuse")
    with pytest.raises(ScheduleValueError, match=r"^<root>: subgraph 0 contains the placeholder node 'x' of '<root>'; "
                                                 r"a subgraph to checkpoint holds operations only$"):
        validate_subgraphs(sch, [("", "x")], "checkpoint")
    with pytest.raises(ScheduleValueError, match=r"^<root>: fuse of subgraph 0 would create a cycle: 'tanh' feeds "
                                                 r"'sigmoid' outside the subgraph, which feeds 'mul' inside it; add "
                                                 r"'sigmoid' to the subgraph or split it$"):
        validate_subgraphs(sch, [("", "tanh"), ("", "mul")], "fuse")
    with pytest.raises(ScheduleValueError, match=r"^<root>: replace of the subgraphs together would create a cycle"):
        validate_subgraphs(sch, [[("", "tanh")], [("", "mul")]], "replace")


def test_subgraph_spanning_two_graphs_and_untraced_paths():
    model = nn.Sequential(_Net(), _Net())
    sch = schedlang.create_schedule(model)
    sch.trace()
    with pytest.raises(ScheduleValueError, match=r"^<root>: subgraph 0 spans several traced modules \('0', '1'\); a "
                                                 r"subgraph must lie in one graph"):
        validate_subgraphs(sch, [("0", "tanh"), ("1", "tanh")], "fuse")
    sch2 = schedlang.create_schedule(model)
    sch2.trace(recursive=False)
    with pytest.raises(NotTracedError, match=r"^0: fuse needs a traced module, but this is _Net; call "
                                             r"sch\['0'\]\.trace\(\) first$"):
        validate_subgraphs(sch2, [("0", "tanh")], "fuse")


def test_parameters_are_left_out_and_a_subgraph_must_feed_something():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return x * self.w

    sch = _traced(Scale())
    weight = next(n for n in sch.mod.graph.nodes if n.op == "get_attr")
    mul = next(n for n in sch.mod.graph.nodes if n.op == "call_function")
    assert validate_subgraphs(sch, [("", weight), ("", mul)], "fuse") == [[("", mul)]]
    with pytest.raises(ScheduleValueError, match=r"^<root>: subgraph 0 has no operation \(only parameters\)$"):
        validate_subgraphs(sch, [("", weight)], "fuse")


def test_extract_keeps_parameters_outside_and_orders_inputs_and_outputs():
    sch = _traced()
    gm = sch.mod
    nodes = [_node(sch, n) for n in ("fc", "norm")]
    body, inputs, outputs = extract_subgraph(gm, nodes, functionalize=True)
    assert [getattr(i, "name", None) or i.target for i in inputs] == ["mul", "fc.weight", "fc.bias", "norm.weight",
                                                                      "norm.bias"]
    assert [o.name for o in outputs] == ["norm"]
    assert not list(body.parameters())  # weights are inputs, not copies
    x = torch.randn(3, 6)
    params = [gm.fc.weight, gm.fc.bias, gm.norm.weight, gm.norm.bias]
    torch.testing.assert_close(body(x, *params), gm.norm(gm.fc(x)))
    plain, plain_inputs, _ = extract_subgraph(gm, nodes)
    assert [i.name for i in plain_inputs] == ["mul"] and plain.fc is gm.fc

"""Slapo's ``Schedule`` helpers: tree queries, graph queries that trace on demand, ``trace_until``,
``update_submodule`` and ``create_schedule``'s Slapo arguments."""

import logging
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import schedlang
from schedlang import Schedule
from schedlang.errors import (ArgumentTypeError, NotTracedError, PatternError, ScheduleKeyError, ScheduleTypeError,
                              ScheduleValueError, TraceError)
from tests.helpers.models import MLP, Stack, assert_unchanged, state_snapshot


class _DataDependent(nn.Module):
    """Untraceable without an example input: Python branches on a tensor's value."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else x


def _outputs_and_grads(module, x):
    x = x.clone().requires_grad_(True)
    out = module(x)
    out.backward(torch.randn_like(out, generator=torch.Generator().manual_seed(1)))
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def _assert_same_computation(scheduled, reference, x):
    out, dx, grads = _outputs_and_grads(scheduled, x)
    ref_out, ref_dx, ref_grads = _outputs_and_grads(reference, x)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------- tree queries


def test_get_top_schedule_is_the_root_sharing_the_plan():
    sch = schedlang.create_schedule(Stack())
    top = sch["layers.1.mlp"].get_top_schedule()
    assert top.path == "" and top.mod is sch.mod and top.plan is sch.plan
    assert sch.get_top_schedule().path == ""


def test_tokenize_module_path_joins_indices_to_their_list():
    assert Schedule.tokenize_module_path("layers.0.mlp.fc1") == ["layers.0", "mlp", "fc1"]
    assert Schedule.tokenize_module_path("encoder.layer.11.attention") == ["encoder", "layer.11", "attention"]
    assert Schedule.tokenize_module_path("grid.2.3") == ["grid.2.3"]
    assert Schedule.tokenize_module_path("head") == ["head"]
    assert Schedule.tokenize_module_path("") == []
    sch = schedlang.create_schedule(Stack())
    assert sch.tokenize_module_path("layers.1.norm") == ["layers.1", "norm"]
    # every token names a real submodule of the plain model
    model = Stack()
    for path, _ in model.named_modules():
        prefix = ""
        for token in Schedule.tokenize_module_path(path):
            prefix = f"{prefix}.{token}" if prefix else token
            model.get_submodule(prefix)


def test_tokenize_module_path_errors():
    with pytest.raises(ScheduleValueError, match=r"^tokenize_module_path: '0\.mlp' starts with the index '0'; a path "
                                                 r"starts with a submodule name, e\.g\. 'layers\.0'"):
        Schedule.tokenize_module_path("0.mlp")
    with pytest.raises(ValueError):
        Schedule.tokenize_module_path("3")
    with pytest.raises(ScheduleTypeError, match=r"^tokenize_module_path: expects a dotted module path like "
                                                r"'layers\.0\.mlp', got int 3$"):
        Schedule.tokenize_module_path(3)


def test_get_module_matches_plain_named_modules():
    torch.manual_seed(0)
    model = Stack(hidden=7, inner=13)
    sch = schedlang.create_schedule(model)
    plain = dict(model.named_modules())
    for name, module in plain.items():
        got = sch.get_module(name)
        assert type(got) is type(module) and got is not module, name  # the schedule's copy, never the user's
        assert [n for n, _ in got.named_parameters()] == [n for n, _ in module.named_parameters()]
        for (_, a), (_, b) in zip(got.named_parameters(), module.named_parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert sch.get_module("") is sch.mod
    assert sch["layers.0"].get_module("mlp.fc2") is sch["layers.0.mlp.fc2"].mod
    # the module a call_module node of a traced graph calls
    sch["layers.1"].trace()
    calls = [n for n in sch["layers.1"].mod.graph.nodes if n.op == "call_module"]
    assert [type(sch["layers.1"].get_module(n.target)).__name__ for n in calls] == ["LayerNorm", "GraphModule",
                                                                                     "Dropout"]


def test_get_module_errors():
    sch = schedlang.create_schedule(Stack())
    with pytest.raises(ScheduleKeyError, match=r"^layers\.0: get_module: no submodule 'mlp\.fc3' here \(names are "
                                               r"relative to this schedule's path\); valid names: norm, mlp, "
                                               r"mlp\.fc1, mlp\.act, mlp\.fc2, drop$"):
        sch["layers.0"].get_module("mlp.fc3")
    with pytest.raises(KeyError):
        sch["head"].get_module("weight_norm")
    with pytest.raises(ScheduleKeyError, match=r"^head: get_module: .*valid names: none \(a leaf module\)$"):
        sch["head"].get_module("x")
    with pytest.raises(ScheduleTypeError, match=r"^<root>: get_module expects a submodule name like 'mlp\.fc1', got "
                                                r"int 0$"):
        sch.get_module(0)


# ---------------------------------------------------------------------------------------------- graph queries


def test_find_node_regex_and_predicate_on_a_traced_stack():
    model = Stack()
    sch = schedlang.create_schedule(model)
    sch.trace()
    nodes = sch.find_node(r"fc\d")
    # plain PyTorch: the Linear modules named fc<digit>, found in their parent's graph
    expected = [(name.rpartition(".")[0], name.rpartition(".")[2]) for name, m in model.named_modules()
                if isinstance(m, nn.Linear) and name.rpartition(".")[2] in ("fc1", "fc2")]
    assert [(p, n.target) for p, n in nodes] == expected
    assert all(n.op == "call_module" for _, n in nodes)
    # Slapo matches from the start of the target (re.match), unlike find's search over full names
    assert sch.find_node(r"c1") == []
    assert len(sch.find(r"c1")) == 2
    assert [(p, n.target) for p, n in sch.find_node(r"layers\.\d")] == [("", "layers.0"), ("", "layers.1")]
    # a predicate over nodes: the residual adds of both blocks
    adds = sch.find_node(lambda n: n.op == "call_function" and n.target in (operator.add, torch.add))
    assert [p for p, _ in adds] == ["layers.0", "layers.1"]
    assert all(n.graph is sch[p].mod.graph for p, n in adds)
    assert len(sch.plan) == 1  # the trace: queries record nothing


def test_graph_queries_trace_an_untraced_module_on_demand(caplog):
    sch = schedlang.create_schedule(Stack())
    with caplog.at_level(logging.INFO, logger="schedlang.primitives.find"):
        nodes = sch["layers.0"].find_node(r"mlp")
    assert [(p, n.target) for p, n in nodes] == [("", "mlp")]
    assert isinstance(sch["layers.0"].mod, fx.GraphModule) and not isinstance(sch.mod, fx.GraphModule)
    assert [(s.primitive, s.path, s.args["flatten"]) for s in sch.plan] == [("trace", "layers.0", False)]
    assert "layers.0: find_node traced this module on demand (trace(flatten=False), recorded as step 0)" in caplog.text
    # find and find_subgraph do the same; a module traced already is not traced again
    sub = sch["layers.1"].find_subgraph(lambda x: F.gelu(x))
    assert [[(p, n.target) for p, n in sg] for sg in sub] == [[("mlp", "act")]]
    assert sch["layers.0"].find(r"mlp\.fc1")[0][0] == "mlp"
    assert [(s.primitive, s.path) for s in sch.plan] == [("trace", "layers.0"), ("trace", "layers.1")]
    # the plan replays: the on-demand traces are ordinary steps
    replayed = schedlang.replay(sch.plan.to_json(), Stack())
    assert isinstance(replayed["layers.1"].mod, fx.GraphModule)


def test_find_subgraph_matches_what_find_matches():
    model = MLP(hidden=7, inner=13)
    sch = schedlang.create_schedule(model)
    sch["fc1"].decompose()
    sch.trace(flatten=True)
    sub = sch.find_subgraph(lambda x, bias: F.gelu(bias + x))
    assert [[(p, n.name) for p, n in sg] for sg in sub] == [[("", "add"), ("", "act")]]
    assert sch.find_subgraph(lambda x: torch.tanh(x)) == []


def test_graph_query_errors_change_nothing():
    sch = schedlang.create_schedule(Stack())
    with pytest.raises(PatternError, match=r"^<root>: find_node got an invalid regex '\(fc': "):
        sch.find_node("(fc")
    with pytest.raises(ArgumentTypeError, match=r"^layers\.0: find_node expects a regex string or a function "
                                                r"node -> bool, got int 3; to match a subgraph pattern use "
                                                r"find_subgraph$") as info:
        sch["layers.0"].find_node(3)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)  # Slapo raised ValueError
    with pytest.raises(ArgumentTypeError, match=r"^<root>: find_subgraph expects a pattern function or an "
                                                r"nn\.Module, got str 'fc1'; to select nodes by a regex over "
                                                r"module names use find_node$"):
        sch.find_subgraph("fc1")
    with pytest.raises(ArgumentTypeError, match=r"^<root>: find_subgraph expects .* got NoneType None"):
        sch.find_subgraph(None)
    assert len(sch.plan) == 0 and not isinstance(sch.mod, fx.GraphModule)  # bad queries trace nothing
    with pytest.raises(PatternError, match=r"^<root>: find_node's function raised AttributeError: .* on node 'x' "
                                           r"\(op placeholder\) of the graph at '<root>'; it must return True or "
                                           r"False for every node$"):
        sch.find_node(lambda n: n.target.no_such_attribute)
    broken = schedlang.create_schedule(nn.Sequential(_DataDependent()))
    with pytest.raises(NotTracedError, match=r"^<root>: find_node needs a traced module, and tracing this "
                                             r"Sequential on demand \(trace\(\) with its defaults\) failed: "
                                             r".*used as a condition.*; call sch\.trace\(\.\.\.\) with "
                                             r"leaf_modules= or concrete_args= first$"):
        broken.find_node("fc")
    with pytest.raises(NotTracedError, match=r"^0: find needs a traced module, and tracing this "
                                             r"_DataDependent on demand"):
        broken["0"].find_subgraph(lambda x: F.gelu(x))
    assert len(broken.plan) == 0 and not isinstance(broken.mod, fx.GraphModule)


# ---------------------------------------------------------------------------------------------- trace_until


def test_trace_until_keeps_the_children_of_the_paths_as_calls():
    torch.manual_seed(0)
    model = Stack(hidden=7, inner=13, layers=3)
    sch = schedlang.create_schedule(model)
    sch.trace_until("layers")
    assert isinstance(sch.mod, fx.GraphModule)
    calls = [n.target for n in sch.mod.graph.nodes if n.op == "call_module"]
    assert calls == ["layers.0", "layers.1", "layers.2", "head"]
    for i in range(3):  # the layers stay whole modules, e.g. pipeline cut points
        assert type(sch[f"layers.{i}"].mod).__name__ == "Block"
    (step,) = sch.plan
    assert (step.primitive, step.path, step.args["flatten"], step.args["leaf_modules"]) == (
        "trace", "", False, ["layers.0", "layers.1", "layers.2"])
    scheduled, _ = schedlang.build(sch, init_weights=False)
    scheduled.eval(), model.eval()
    _assert_same_computation(scheduled, model, torch.randn(5, 7))
    assert_unchanged(model, state_snapshot(model))


def test_trace_until_several_paths_the_module_itself_and_slapo_options():
    sch = schedlang.create_schedule(Stack())
    sch.trace_until(["layers.0", "layers.1.mlp"], tracer="huggingface", leaf_modules=[nn.LayerNorm])
    assert type(sch["layers.0.mlp"].mod).__name__ == "MLP"  # a child of layers.0: a call
    assert isinstance(sch["layers.1.mlp"].mod, fx.GraphModule)  # traced down to it
    assert type(sch["layers.1.norm"].mod) is nn.LayerNorm
    assert sch.plan[0].args["leaf_modules"] == ["layers.0.norm", "layers.0.mlp", "layers.0.drop", "layers.1.mlp.fc1",
                                                "layers.1.mlp.act", "layers.1.mlp.fc2", nn.LayerNorm]
    only = schedlang.create_schedule(Stack())
    only["layers.0"].trace_until("", tracer="pytorch")
    assert [n.target for n in only["layers.0"].mod.graph.nodes if n.op == "call_module"] == ["norm", "mlp", "drop"]
    assert type(only["layers.0.mlp"].mod).__name__ == "MLP"


def test_trace_until_errors():
    sch = schedlang.create_schedule(Stack())
    with pytest.raises(ScheduleKeyError, match=r"^layers: no submodule '7' \(looking up 'layers\.7'\); valid "
                                               r"children: 0, 1$"):
        sch.trace_until("layers.7")
    with pytest.raises(ScheduleTypeError, match=r"^<root>: trace_until expects a submodule path or a non-empty "
                                                r"list of paths \(strings relative to this schedule\), got \[\]$"):
        sch.trace_until([])
    with pytest.raises(ScheduleTypeError, match=r"^<root>: trace_until got unknown options flatten; valid options "
                                                r"are leaf_modules, concrete_args, tracer$"):
        sch.trace_until("layers", flatten=True)
    with pytest.raises(ScheduleValueError, match=r"^<root>: unknown tracer 'jit'"):
        sch.trace_until("layers", tracer="jit")
    assert len(sch.plan) == 0
    sch.trace_until("layers")
    with pytest.raises(TraceError, match=r"^<root>: trace_until traces a module not traced yet, but this one is "
                                         r"traced already \(GraphModule\); call trace_until before trace") as info:
        sch.trace_until("layers")
    assert isinstance(info.value, RuntimeError)  # as Slapo's


# ---------------------------------------------------------------------------------------------- update_submodule


def test_update_submodule_is_a_replace_step():
    torch.manual_seed(0)
    model = Stack(hidden=7, inner=13)
    before = state_snapshot(model)
    sch = schedlang.create_schedule(model)
    sub = sch["layers.1.mlp.act"]
    sub.update_submodule(sub.parent.mod, sub.name, nn.ReLU())  # how Slapo's replace calls it
    sch.update_submodule(sch.mod, "layers.0.mlp.act", nn.Tanh())
    assert [(s.primitive, s.path) for s in sch.plan] == [("replace", "layers.1.mlp.act"),
                                                         ("replace", "layers.0.mlp.act")]
    assert type(sch["layers.1.mlp.act"].mod) is nn.ReLU and type(sch["layers.0.mlp.act"].mod) is nn.Tanh
    assert_unchanged(model, before)
    # plain PyTorch: the same swap made by hand on a copy
    import copy

    reference = copy.deepcopy(model)
    reference.layers[1].mlp.act = nn.ReLU()
    reference.layers[0].mlp.act = nn.Tanh()
    scheduled, _ = schedlang.build(sch, init_weights=False)
    scheduled.eval(), reference.eval()
    _assert_same_computation(scheduled, reference, torch.randn(3, 11, 7))


def test_update_submodule_errors():
    model = Stack()
    sch = schedlang.create_schedule(model)
    with pytest.raises(ScheduleValueError, match=r"^layers\.0: update_submodule got a Stack that is not part of "
                                                 r"this schedule's model; pass sch\.mod or a module under it"):
        sch["layers.0"].update_submodule(model, "head", nn.Identity())
    with pytest.raises(ScheduleKeyError, match=r"^layers\.0\.mlp: no submodule 'gelu' \(looking up "
                                               r"'layers\.0\.mlp\.gelu'\); valid children: fc1, act, fc2$"):
        sch.update_submodule(sch["layers.0.mlp"].mod, "gelu", nn.ReLU())
    with pytest.raises(ScheduleTypeError, match=r"^<root>: update_submodule expects the child's name \(a non-empty "
                                                r"dotted path like 'layers\.0'\), got ''$"):
        sch.update_submodule(sch.mod, "", nn.ReLU())
    with pytest.raises(ScheduleTypeError):
        sch.update_submodule(sch.mod, "head", "not a module")
    assert len(sch.plan) == 0


# ---------------------------------------------------------------------------------------------- create_schedule


def test_create_schedule_takes_slapos_arguments():
    model = Stack()
    sch = schedlang.create_schedule(model, name="", path="")
    assert sch.path == "" and sch.mod is not model
    labelled = schedlang.create_schedule(model, "bert", "bert", None, None)  # Slapo's positional order
    assert labelled.path == "" and labelled["layers.0"].path == "layers.0"  # paths stay relative to the model
    assert schedlang.create_schedule(root=model).mod is not model
    # with parent=, the view of that module inside the parent's schedule (one plan)
    child = schedlang.create_schedule(sch["layers.1"].mod, name="layers.1", path="layers.1", parent=sch)
    assert child.path == "layers.1" and child.plan is sch.plan
    assert schedlang.create_schedule(sch["layers.0.mlp"].mod, parent=sch["layers.1"]).path == "layers.0.mlp"
    assert schedlang.create_schedule(model.layers[0], parent=sch).path == "layers.0"  # the user's module, by path
    child["mlp.act"].replace(nn.ReLU())
    assert [(s.primitive, s.path) for s in sch.plan] == [("replace", "layers.1.mlp.act")]


def test_create_schedule_errors():
    model = Stack()
    with pytest.raises(ScheduleTypeError, match=r"^create_schedule: unknown arguments colour; valid arguments are "
                                                r"model \(or root\), name, path, parent, group, mesh$"):
        schedlang.create_schedule(model, colour="red")
    with pytest.raises(ScheduleTypeError, match=r"^create_schedule: name must be a string \(Slapo's module name, '' "
                                                r"for a whole model\), got int 3; pass a process group as group="):
        schedlang.create_schedule(model, 3)
    sch = schedlang.create_schedule(model)
    with pytest.raises(ScheduleTypeError, match=r"^create_schedule: parent must be a Schedule \(or None for a new "
                                                r"schedule\), got Stack$"):
        schedlang.create_schedule(model.head, parent=model)
    with pytest.raises(ScheduleValueError, match=r"^create_schedule: the parent schedule has a Linear at path "
                                                 r"'head', not the Block given; pass the module at that path "
                                                 r"\(parent\['head'\]\.mod\) or its path$"):
        schedlang.create_schedule(model.layers[0], path="head", parent=sch)
    with pytest.raises(ScheduleValueError, match=r"^create_schedule: the Linear given with parent= is not a module "
                                                 r"of the parent schedule's model; pass path="):
        schedlang.create_schedule(nn.Linear(2, 2), parent=sch)
    with pytest.raises(ScheduleValueError, match=r"^create_schedule: a schedule made with parent= uses the parent's "
                                                 r"process group and mesh; pass group= and mesh= only to the parent's create_schedule$"):
        schedlang.create_schedule(model.head, parent=sch, group=object())
    with pytest.raises(ScheduleKeyError, match=r"^<root>: no submodule 'tail'"):
        schedlang.create_schedule(model.head, path="tail", parent=sch)


def test_find_node_whose_function_raises_leaves_an_untraced_schedule_untraced():
    """find() is all-or-nothing; find_node traces on demand too, so a failing predicate must undo that trace."""
    sch = schedlang.create_schedule(Stack())
    with pytest.raises(PatternError, match=r"^<root>: find_node's function raised KeyError: 'x' on node "):
        sch.find_node(lambda n: n.meta["x"])
    assert len(sch.plan) == 0 and not isinstance(sch.mod, fx.GraphModule)
    # the same query with a working function still traces on demand and records the trace
    assert sch.find_node(lambda n: n.op == "output") and [s.primitive for s in sch.plan] == ["trace"]


@pytest.mark.parametrize("group", [5, "tp", object()], ids=["int", "str", "object"])
def test_create_schedule_refuses_a_group_that_is_not_a_process_group(group):
    with pytest.raises(ScheduleValueError, match=r"^create_schedule: group must be a torch\.distributed ProcessGroup "
                                                 r"\(e\.g\. from torch\.distributed\.new_group\) or None \(the world\), "
                                                 rf"got {type(group).__name__} .*; pass a DeviceMesh as mesh=, not as "
                                                 r"group=$") as info:
        schedlang.create_schedule(Stack(), group=group)
    assert isinstance(info.value, TypeError)  # a wrong type, as create_schedule's other argument checks say


def test_create_schedule_accepts_none_and_the_single_rank_group():
    from schedlang.distributed.groups import SINGLE_RANK

    assert schedlang.create_schedule(Stack(), group=None).group is None
    assert schedlang.create_schedule(Stack(), group=SINGLE_RANK).group is SINGLE_RANK


# ---------------------------------------------------------------------------------------------- a Slapo script


def test_slapo_style_script_with_only_the_import_changed():
    import schedlang as slapo

    class SlapoMLP(nn.Module):
        def __init__(self, hidden, inner):
            super().__init__()
            self.linear1 = nn.Linear(hidden, inner)
            self.activation = nn.GELU()
            self.linear2 = nn.Linear(inner, hidden)

        def forward(self, data):
            return self.linear2(self.activation(self.linear1(data)))

    torch.manual_seed(0)
    model = SlapoMLP(13, 29)
    sch = slapo.create_schedule(model, name="", path="", parent=None, group=None)
    sch["linear1"].decompose()
    sch.trace(flatten=True)
    ops = sch.find_node(r"linear\d")
    assert [(path, node.target) for path, node in ops] == [("", "linear2")]  # linear1 is decomposed
    assert isinstance(sch.get_module(ops[0][1].target), nn.Linear)
    assert sch.get_top_schedule() is not None and sch.tokenize_module_path("linear2") == ["linear2"]

    def pattern(x, bias):
        return F.gelu(bias + x)

    subgraph = sch.find_subgraph(pattern)
    assert [[n.name for _, n in sg] for sg in subgraph] == [["add", "activation"]]
    sch.fuse(subgraph, compiler="eager", name="BiasGeLU")
    # swap linear2 for an equal Linear with a different layout, through Slapo's helper
    old = sch.get_module("linear2")
    new = nn.Linear(29, 13)
    with torch.no_grad():
        new.weight.copy_(old.weight)
        new.bias.copy_(old.bias)
    sch.update_submodule(sch.mod, "linear2", new)
    assert [s.primitive for s in sch.plan] == ["decompose", "trace", "fuse", "replace"]
    opt_model, _ = slapo.build(sch, init_weights=False)
    assert any(type(m).__name__ != "GELU" and "BiasGeLU" in n for n, m in opt_model.named_children())
    _assert_same_computation(opt_model, model, torch.randn(7, 13))

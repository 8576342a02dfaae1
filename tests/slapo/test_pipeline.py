"""``trace_until`` keeps untraceable modules whole, and ``generate_pipeline_partition`` splits a model
traced level by level the way Slapo does (stage names, nesting, same computation)."""

import logging

import pytest
import torch
import torch.fx as fx
from torch import nn

import schedlang
from schedlang.errors import PipelineError, TraceError
from schedlang.pipeline import generate_pipeline_partition
from tests.helpers.models import assert_unchanged, state_snapshot


class Gate(nn.Module):
    """Branches on a tensor's value: FX cannot trace it without an example."""

    def __init__(self, width=10):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        if x.sum() > -1e9:
            return self.linear(x)
        return x


class Inner(nn.Module):
    def __init__(self, width=10):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Post(nn.Module):
    def __init__(self, width=10):
        super().__init__()
        self.linear = nn.Linear(width, 3)

    def forward(self, x):
        return self.linear(x) * 2


class SeqModel(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.pre = Gate()
        self.layers = nn.Sequential(*[Inner() for _ in range(layers)])
        self.post = Post()

    def forward(self, x):
        return self.post(self.layers(self.pre(x)))


class ListModel(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.pre = Gate()
        self.layers = nn.ModuleList([Inner() for _ in range(layers)])
        self.post = Post()

    def forward(self, x):
        x = self.pre(x)
        for layer in self.layers:
            x = layer(x)
        return self.post(x)


def _same_computation(split: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    xs, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, ref = split(xs), model(xr)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(xs.grad, xr.grad)
    # the split holds copies of the parameters under other names: compare the gradients as a multiset
    def ordered(module):
        grads = [p.grad for p in module.parameters()]
        return sorted(grads, key=lambda g: (tuple(g.shape), float(g.sum())))

    split_grads, ref_grads = ordered(split), ordered(model)
    assert len(split_grads) == len(ref_grads)
    for a, b in zip(split_grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_trace_until_keeps_an_untraceable_child_whole_and_logs_it(caplog):
    torch.manual_seed(0)
    model = SeqModel()
    before = state_snapshot(model)
    sch = schedlang.create_schedule(model)
    with caplog.at_level(logging.INFO, logger="schedlang.trace_until"):
        sch.trace_until("layers", tracer="pytorch")
    assert "trace_until keeps pre whole" in caplog.text and "used as a condition" in caplog.text
    assert isinstance(sch.mod, fx.GraphModule) and type(sch["pre"].mod) is Gate
    assert isinstance(sch["layers"].mod, fx.GraphModule) and isinstance(sch["post"].mod, fx.GraphModule)
    assert type(sch["layers.0"].mod) is Inner and type(sch["layers.1"].mod) is Inner
    (step,) = sch.plan
    assert step.args["leaf_modules"] == ["layers.0", "layers.1", "pre"]
    x = torch.randn(4, 10)
    torch.testing.assert_close(sch.mod(x), model(x))
    # the plan replays to the same graphs
    again = schedlang.replay(sch.plan.to_json(), SeqModel())
    assert type(again["pre"].mod) is Gate and isinstance(again["layers"].mod, fx.GraphModule)
    assert_unchanged(model, before)


def test_trace_until_the_items_of_a_module_list_stay_calls():
    sch = schedlang.create_schedule(ListModel())
    sch.trace_until("", tracer="pytorch")
    assert [n.target for n in sch.mod.graph.nodes if n.op == "call_module"] == ["pre", "layers.0", "layers.1", "post"]
    assert type(sch["layers.0"].mod) is Inner and type(sch["post"].mod) is Post
    assert sch.plan[0].args["leaf_modules"] == ["pre", "layers.0", "layers.1", "post"]


def test_trace_until_still_fails_loudly_on_its_own_module():
    sch = schedlang.create_schedule(Gate())
    with pytest.raises(TraceError, match=r"^<root>: .*used as a condition"):
        sch.trace_until("")
    assert len(sch.plan) == 0 and type(sch.mod) is Gate
    # and plain trace does not fall back: the child's failure is an error there
    sch = schedlang.create_schedule(SeqModel())
    with pytest.raises(TraceError, match=r"^pre: .*used as a condition"):
        sch.trace()
    assert len(sch.plan) == 0


def test_partition_of_a_traced_sequential_nests_pieces_like_slapo():
    torch.manual_seed(0)
    model = SeqModel(layers=3)
    sch = schedlang.create_schedule(model)
    sch.trace_until("layers")
    sch["layers.0"].cut_pipeline_stage()
    parts = generate_pipeline_partition(sch)
    assert list(parts.child) == ["submod_0", "submod_1"]
    assert type(parts["submod_0.pre"].mod) is Gate
    assert isinstance(parts["submod_0.submod_0"].mod, fx.GraphModule)
    assert type(parts["submod_0.submod_0.0"].mod) is Inner
    assert isinstance(parts["submod_1.submod_1"].mod, fx.GraphModule)
    assert [type(parts[f"submod_1.submod_1.{i}"].mod) for i in (1, 2)] == [Inner, Inner]
    assert isinstance(parts["submod_1.post"].mod, fx.GraphModule)
    assert parts["submod_1.post"].metadata["partition_idx"] == 1
    _same_computation(parts.mod, model, torch.randn(5, 10))
    # the schedule's own model is not split
    assert [n.target for n in sch.mod.graph.nodes if n.op == "call_module"] == ["pre", "layers", "post"]


def test_partition_of_a_module_list_model_and_several_cuts():
    torch.manual_seed(0)
    model = ListModel(layers=3)
    sch = schedlang.create_schedule(model)
    sch.trace_until("")
    sch["layers.0"].cut_pipeline_stage()
    parts = generate_pipeline_partition(sch)
    assert [list(c.child) for c in parts.child.values()] == [["pre", "layers_0"], ["layers_1", "layers_2", "post"]]
    assert type(parts["submod_1.post"].mod) is Post and isinstance(parts["submod_1"].mod, fx.GraphModule)
    _same_computation(parts.mod, model, torch.randn(5, 10))

    sch = schedlang.create_schedule(model)
    sch.trace_until("layers")
    for cut in ("pre", "layers.0", "layers.1"):
        sch[cut].cut_pipeline_stage()
    parts = generate_pipeline_partition(sch)
    assert [list(c.child) for c in parts.child.values()] == [["pre"], ["layers_0"], ["layers_1"], ["layers_2", "post"]]
    _same_computation(parts.mod, model, torch.randn(7, 10))


def test_partition_of_traced_hf_models_computes_the_same():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=50, bos_token_id=0,
                                       eos_token_id=0)).eval()
    sch = schedlang.create_schedule(model)
    sch.trace_until("transformer.h")
    sch["transformer.h.0"].cut_pipeline_stage()
    sch["transformer.h.1"].cut_pipeline_stage()
    parts = generate_pipeline_partition(sch)
    assert [list(c.child) for c in parts.child.values()] == [["submod_0"], ["submod_1"], ["submod_2", "lm_head"]]
    assert isinstance(parts["submod_2.submod_2"].mod, fx.GraphModule)
    ids = torch.randint(0, 50, (2, 9))
    torch.testing.assert_close(parts.mod(ids).logits, model(ids).logits)


def test_partition_errors():
    sch = schedlang.create_schedule(SeqModel())
    sch.trace_until("")
    sch["layers.1"].cut_pipeline_stage()
    with pytest.raises(PipelineError, match=r"^layers\.1: cut_pipeline_stage\(\) marks a module that no traced graph "
                                            r"calls; trace the model down to its parent first "
                                            r"\(sch\.trace_until\('layers'\)\)$"):
        generate_pipeline_partition(sch)

"""Behaviours a Slapo schedule script relies on: loose pattern inputs, hook transfer on
replace, concrete arguments for a replacement, extra arguments for replace_all's factory."""

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import schedlang
from schedlang.errors import ScheduleValueError
from schedlang.graph import find_subgraphs
from schedlang.pattern import call_module


class _ScaledResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(13, 13)

    def forward(self, x):
        return torch.tanh(self.proj(x)) + x


def test_a_pattern_input_used_twice_may_match_two_values():
    sch = schedlang.create_schedule(_ScaledResidual())
    (sub,) = sch.find(lambda x: torch.tanh(x) + x)
    assert [n.target for _, n in sub] == [torch.tanh, operator.add]
    assert find_subgraphs(sch.mod, lambda x: torch.tanh(x) + x, strict=True) == []


def test_a_loose_match_is_replaced_with_its_real_inputs():
    model = _ScaledResidual()
    x = torch.randn(7, 13)
    expected = model(x)
    sch = schedlang.create_schedule(model)
    sub = sch.find(lambda x: torch.tanh(x) + x)

    class TanhPlus(nn.Module):
        def forward(self, a, b):
            return torch.tanh(a) + b

    sch.replace(TanhPlus(), target_ops=sub)
    torch.testing.assert_close(sch.mod(x), expected)


def test_a_diamond_whose_intermediate_is_used_elsewhere_is_found():
    class Diamond(nn.Module):
        def forward(self, x, y):
            a = x + y
            return (a * 2 + a * 3) + a * 5

    sch = schedlang.create_schedule(Diamond())

    def pattern(m, n):
        a = m + n
        return a * 2 + a * 3

    (sub,) = sch.find(pattern)
    assert [n.target for _, n in sub] == [operator.add, operator.mul, operator.mul, operator.add]


class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(11, 11)
        self.norm = nn.LayerNorm(11)

    def forward(self, x):
        return self.norm(self.linear(x))


def test_replace_moves_the_chain_ends_hooks_to_the_new_module():
    sch = schedlang.create_schedule(_Chain())
    seen = []
    sch.mod.linear.register_forward_pre_hook(lambda m, inp: seen.append("pre"))
    sch.mod.norm.register_forward_hook(lambda m, inp, out: seen.append("post"))
    sub = sch.find(lambda x: call_module("norm", call_module("linear", x)))
    fused = nn.Sequential(nn.Linear(11, 11), nn.LayerNorm(11))
    sch.replace(fused, target_ops=sub, name="fused")
    assert len(fused._forward_pre_hooks) == 1 and len(fused._forward_hooks) == 1
    sch.mod(torch.randn(3, 11))
    assert seen == ["pre", "post"]


def test_replace_refuses_a_hook_inside_the_chain_and_changes_nothing():
    sch = schedlang.create_schedule(_Chain())
    sch.mod.linear.register_forward_hook(lambda m, inp, out: out)
    sub = sch.find(lambda x: call_module("norm", call_module("linear", x)))
    code = sch.mod.code
    with pytest.raises(ScheduleValueError, match=r"^<root>: cannot replace 'linear': module 'linear' has fwd_post "
                                                 r"hooks, which the replacement cannot keep for the first module"):
        sch.replace(nn.Identity(), target_ops=sub)
    assert sch.mod.code == code


def test_concrete_args_fill_the_parameters_the_subgraph_has_no_input_for():
    model = _ScaledResidual()
    x = torch.randn(5, 13)
    sch = schedlang.create_schedule(model)
    sub = sch.find(lambda x: torch.tanh(x) + x)

    class Weighted(nn.Module):
        def forward(self, a, b, scale):
            return torch.tanh(a) + scale * b

    with pytest.raises(ScheduleValueError, match=r"cannot be called with the 2 input\(s\) of the subgraph\(s\) "
                                                 r"\(proj, x\): missing a required argument: 'scale'; give the "
                                                 r"missing ones with concrete_args=\{name: value\}$"):
        sch.replace(Weighted(), target_ops=sub)
    sch.replace(Weighted(), target_ops=sub, concrete_args={"scale": 0.5})
    with torch.no_grad():
        expected = torch.tanh(model.proj(x)) + 0.5 * x
    torch.testing.assert_close(sch.mod(x), expected)


def test_a_failed_replace_raises_and_leaves_no_module_behind():
    # Slapo registers the new module before checking that the subgraph's inputs fit its forward, so
    # after the failed call the module stays in the model and the next replace is named ``NewMod_1``.
    # schedlang applies a primitive all or nothing: the failed call raises, the model, its graph and
    # the plan are as before, and the next replace takes the first free name.
    model = _ScaledResidual()
    x = torch.randn(5, 13)
    sch = schedlang.create_schedule(model)
    sub = sch.find(lambda x: torch.tanh(x) + x)

    class Weighted(nn.Module):
        def forward(self, a, b, scale):
            return torch.tanh(a) + scale * b

    def state():
        return (list(sch.child), [name for name, _ in sch.mod.named_modules()], sch.mod.code, sch.plan.to_json())

    before = state()
    with pytest.raises(ScheduleValueError, match=r"^<root>: Weighted\(a, b, scale\) cannot be called with the 2 "
                                                 r"input\(s\)"):
        sch.replace(Weighted(), target_ops=sub)
    assert state() == before
    assert not any(isinstance(m, Weighted) for m in sch.mod.modules())
    sch.replace(Weighted(), target_ops=sub, concrete_args={"scale": 0.25})
    assert [name for name in sch.child if name.startswith("Weighted")] == ["Weighted_0"]
    with torch.no_grad():
        torch.testing.assert_close(sch.mod(x), torch.tanh(model.proj(x)) + 0.25 * x)


def test_concrete_args_need_subgraphs():
    sch = schedlang.create_schedule(_ScaledResidual())
    with pytest.raises(ScheduleValueError, match=r"^proj: concrete_args= only applies when replacing subgraphs"):
        sch["proj"].replace(nn.Linear(13, 13), concrete_args={"a": 1})


def test_replace_all_passes_extra_arguments_to_the_factory():
    model = nn.Sequential(nn.Linear(7, 7), nn.Linear(7, 7))
    sch = schedlang.create_schedule(model)

    def make(path, old, act, scale=1.0):
        return nn.Sequential(old, act(), nn.Identity() if scale == 2.0 else nn.Tanh())

    sch.replace_all(nn.Linear, make, nn.ReLU, scale=2.0)
    for path in ("0", "1"):
        assert isinstance(sch[path].mod[0], nn.Linear) and isinstance(sch[path].mod[1], nn.ReLU)
        assert isinstance(sch[path].mod[2], nn.Identity)
    x = torch.randn(4, 7)
    torch.testing.assert_close(sch.mod(x), F.relu(model[1](F.relu(model[0](x)))))
    assert "make_fn_kwargs={'scale': 2.0}" in str(sch.plan)


def test_gen_embedding_hooks_on_one_rank_keep_the_embedding():
    from schedlang.model_schedule.gpt2 import gen_embedding_hooks

    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 7))
    sch = schedlang.create_schedule(model)
    pre, post = gen_embedding_hooks(sch, 50)
    sch["0"].sync(mode="fwd_pre", sync_op_or_fn=pre)
    sch["0"].sync(mode="fwd_post", sync_op_or_fn=post)
    ids = torch.randint(0, 50, (3, 9))
    torch.testing.assert_close(sch.mod(ids), model(ids))
    with pytest.raises(ScheduleValueError, match=r"^<root>: embedding ids must lie in \[0, 50\), got values in "
                                                 r"\[0, 50\]"):
        sch.mod(torch.tensor([[0, 50]]))
    with pytest.raises(ScheduleValueError, match=r"^<root>: gen_embedding_hooks needs the vocabulary size as an int "
                                                 r"of at least the group size 1, got 'x'"):
        gen_embedding_hooks(sch, "x")


def test_a_checkpointed_subgraph_is_a_checkpoint_wrapper_holding_its_modules():
    class TwoLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1, self.layer2 = nn.Linear(9, 9), nn.Linear(9, 9)

        def forward(self, x):
            return self.layer2(F.relu(self.layer1(x)))

    model = TwoLayers()
    sch = schedlang.create_schedule(model)
    sch.checkpoint(sch.find(lambda x: F.relu(call_module("layer1", x))))
    wrapper = sch["CheckPointWrapper_0"].mod
    assert wrapper.mod.layer1 is sch.mod.layer1
    x = torch.randn(6, 9, requires_grad=True)
    out = sch.mod(x)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    ref_x = x.detach().clone().requires_grad_(True)
    model(ref_x).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(sch.mod.layer1.weight.grad, model.layer1.weight.grad)


class _Topology:
    """pp stages of tp ranks each, numbered stage-major (DeepSpeed's order for pp x tp, dp=1)."""

    def __init__(self, tp):
        self.tp = tp

    def filter_match(self, pipe):
        return [pipe * self.tp + i for i in range(self.tp)]


def test_analyze_tie_ranks_groups_the_same_position_of_every_stage():
    from schedlang.framework_dialect.deepspeed.pipeline import analyze_tie_ranks

    groups = [[("wte.weight", 0), ("lm_head.weight", 4)], [("a.weight", 2), ("b.weight", 1), ("c.weight", 3)]]
    ranks, stages = analyze_tie_ranks(groups, _Topology(tp=3))
    assert ranks == [[[0, 12], [1, 13], [2, 14]], [[3, 6, 9], [4, 7, 10], [5, 8, 11]]]
    assert stages == [[0, 4], [1, 2, 3]]


def test_analyze_tie_ranks_refuses_stages_of_different_sizes():
    from schedlang.framework_dialect.deepspeed.pipeline import analyze_tie_ranks

    class Uneven:
        def filter_match(self, pipe):
            return list(range(pipe + 1))

    with pytest.raises(ScheduleValueError, match=r"^analyze_tie_ranks: the stages of tied weight 'w' hold different "
                                                 r"numbers of ranks \(\{0: 1, 1: 2\}\)"):
        analyze_tie_ranks([[("w", 0), ("w", 1)]], Uneven())


class _TiedStages(torch.nn.Module):
    """An embedding whose weight two later Linears share (Slapo's pipeline tie test shape)."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(8, 8)
        self.first = torch.nn.Linear(8, 8, bias=False)
        self.second = torch.nn.Linear(8, 8, bias=False)
        self.single = torch.nn.Linear(8, 8, bias=False)
        self.first.weight = self.wte.weight
        self.second.weight = self.wte.weight

    def forward(self, ids):
        return self.single(self.second(self.first(self.wte(ids))))


def test_metadata_reads_tied_weights_from_the_model_and_keeps_notes():
    sch = schedlang.create_schedule(_TiedStages())
    tied = sch.metadata.tie_weights
    assert list(tied) == [sch.mod.wte.weight] and tied[sch.mod.wte.weight] is sch.mod.wte.weight
    sch["wte"].shard("weight", axis=0)
    # the tie survives sharding, so the mapping names the new shard
    assert list(sch.metadata.tie_weights) == [sch.mod.wte.weight]
    sch.metadata["note"] = 1
    assert sch.metadata["note"] == 1 and dict(sch.metadata) == {"note": 1} and sch.metadata.primitives == {"note": 1}


def test_sharding_each_holder_of_a_tied_tensor_is_done_once():
    sch = schedlang.create_schedule(_TiedStages())
    sch["wte"].shard("weight", axis=0)
    shard = sch.mod.wte.weight
    # Slapo scripts shard every holder; the first call sharded all of them, so these change nothing
    sch["first"].shard("weight", axis=0)
    sch["second"].shard("weight", axis=0)
    assert sch.mod.first.weight is shard and sch.mod.second.weight is shard
    # another axis, or a tensor only one module holds, is still an error
    with pytest.raises(schedlang.ShardError, match=r"^first: 'weight' is already sharded \(along axis 0\)"):
        sch["first"].shard("weight", axis=1)
    sch["single"].shard("weight", axis=0)
    with pytest.raises(schedlang.ShardError, match=r"^single: 'weight' is already sharded \(along axis 0\)"):
        sch["single"].shard("weight", axis=0)
    again = schedlang.replay(sch.plan.to_json(), _TiedStages())
    assert again.mod.first.weight is again.mod.wte.weight

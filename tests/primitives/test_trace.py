"""``Schedule.trace``: the primitive, its plan step, its errors, and what earlier steps keep."""

import pytest
import torch
import torch.fx as fx
from torch import nn

import schedlang
from schedlang.errors import ScheduleKeyError, ScheduleTypeError, ScheduleValueError
from schedlang.graph import PH
from schedlang.module_record import module_record, shard_specs
from tests.helpers.models import MLP, Stack, assert_unchanged, state_snapshot


def _fwd_bwd(module, x):
    x = x.clone().requires_grad_(True)
    out = module(x)
    out.backward(torch.ones_like(out) * 0.5)
    return out, x.grad


def test_trace_replaces_the_module_records_a_step_and_replays():
    model = Stack().eval()
    before = state_snapshot(model)
    sch = schedlang.create_schedule(model)
    sch["layers.0"].trace(flatten=True)
    assert isinstance(sch["layers.0"].mod, fx.GraphModule) and not isinstance(sch.mod, fx.GraphModule)
    assert [s.primitive for s in sch.plan] == ["trace"]
    assert sch.plan[0].path == "layers.0"
    x = torch.randn(7, 13, 12)
    torch.testing.assert_close(sch.mod(x), model(x))
    replayed = schedlang.replay(sch.plan.to_json(), Stack().eval())
    assert replayed["layers.0"].mod.code == sch["layers.0"].mod.code
    assert_unchanged(model, before)


def test_example_inputs_and_placeholders_are_written_to_the_plan():
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x, mask=None):
            y = self.proj(x).view(*x.shape[:-1], 2, -1)
            y = y.flatten(-2)
            return y if mask is None else y * mask

    model = Heads()
    sch = schedlang.create_schedule(model)
    sch.trace(concrete_args={"x": torch.randn(2, 3, 8), "mask": PH})
    data = sch.plan.to_dict()["steps"][0]["args"]["concrete_args"]
    assert data == {"x": {"tensor_example": {"shape": [2, 3, 8], "dtype": "float32"}}, "mask": {"placeholder": True}}
    x, mask = torch.randn(5, 4, 8), torch.randn(5, 4, 8)
    torch.testing.assert_close(sch.mod(x, mask), model(x, mask))
    replayed = schedlang.replay(sch.plan.to_json(), model)
    torch.testing.assert_close(replayed.mod(x, mask), model(x, mask))


def test_leaf_module_types_are_written_to_the_plan_by_name():
    sch = schedlang.create_schedule(Stack())
    sch.trace(leaf_modules=[MLP, "layers.1.norm"])
    args = sch.plan.to_dict()["steps"][0]["args"]
    assert args["leaf_modules"] == [{"module_type": "tests.helpers.models.MLP"}, "layers.1.norm"]
    replayed = schedlang.replay(sch.plan.to_json(), Stack())
    assert type(replayed["layers.0.mlp"].mod) is MLP


def test_argument_errors_are_explained():
    sch = schedlang.create_schedule(Stack())
    with pytest.raises(ScheduleTypeError, match=r"^<root>: trace flatten must be True or False, got 1$"):
        sch.trace(flatten=1)
    with pytest.raises(ScheduleValueError, match=r"^<root>: unknown tracer 'jit': valid tracers are 'fx', 'pytorch', "
                                                 r"'huggingface'$"):
        sch.trace(tracer="jit")
    with pytest.raises(ScheduleValueError, match=r"^<root>: tracer 'dynamo' is not supported: its graph \(ATen "
                                                 r"operators, modules renamed\) is not the module hierarchy"):
        sch.trace(tracer="dynamo")
    with pytest.raises(ScheduleTypeError, match=r"^<root>: trace config must be a transformers PretrainedConfig "
                                                r"\(Slapo's HF tracer option\), got dict$"):
        sch.trace(config={"hidden_size": 8})
    with pytest.raises(ScheduleKeyError, match=r"^<root>: leaf_modules names 'layers\.7', which is neither a "
                                               r"submodule here \(names are relative to this schedule's path\) nor "
                                               r"the class name of exactly one module type under it$"):
        sch.trace(leaf_modules=["layers.7"])
    with pytest.raises(ScheduleTypeError, match=r"^<root>: leaf_modules entries must be nn.Module subclasses or "
                                                r"submodule names, got 3$"):
        sch.trace(leaf_modules=[3])
    with pytest.raises(ScheduleValueError, match=r"^layers\.0: concrete_args names 'mask', which is not an argument "
                                                 r"of Block.forward; valid arguments are x$"):
        sch["layers.0"].trace(concrete_args={"mask": None})
    with pytest.raises(ScheduleTypeError, match=r"^<root>: concrete_args must be a dict from argument names to "
                                                r"values, got \[1\]$"):
        sch.trace(concrete_args=[1])
    assert len(sch.plan) == 0


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y if y.mean() > 0 else -y


def test_a_failed_trace_raises_names_the_module_and_changes_nothing():
    model = nn.Sequential(nn.Linear(4, 4), _DataDependent())
    sch = schedlang.create_schedule(model)
    before = sch.mod
    with pytest.raises(schedlang.TraceError, match=r"^1: the condition 'gt = gt\(mean, 0\)' depends on tensor data"):
        sch.trace(concrete_args={"input": torch.randn(2, 4)})
    assert sch.mod is before and not isinstance(sch.mod, fx.GraphModule) and len(sch.plan) == 0
    sch.trace(leaf_modules=[_DataDependent], concrete_args={"input": torch.randn(2, 4)})  # the remedy works
    x = torch.randn(3, 4)
    torch.testing.assert_close(sch.mod(x), model(x))


def test_shards_syncs_and_checkpoints_survive_tracing():
    model = Stack(hidden=12, inner=20)
    sch = schedlang.create_schedule(model)
    sch["layers.0.mlp.fc1"].shard("weight", axis=0)
    sch["layers.0.mlp.fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["layers.1"].checkpoint()
    weight = sch["layers.0.mlp.fc1"].mod.weight
    sch.trace()
    fc1 = sch["layers.0.mlp.fc1"].mod
    assert fc1.weight is weight and "weight" in shard_specs(fc1)
    fc2 = sch["layers.0.mlp.fc2"].mod
    assert len(fc2._forward_hooks) == 1 and hasattr(fc2, "_schedlang_sync_fwd_post_0")
    layer1 = sch["layers.1"].mod
    assert module_record(layer1).checkpointed and not isinstance(layer1, fx.GraphModule)
    model.eval()
    sch.mod.eval()
    x = torch.randn(6, 12)
    out, grad = _fwd_bwd(sch.mod, x)
    ref_out, ref_grad = _fwd_bwd(model, x)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)


def test_flattening_inlines_sync_points_as_calls():
    model = MLP(hidden=12, inner=20)
    sch = schedlang.create_schedule(model)
    sch["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["fc1"].decompose()
    sch.trace(flatten=True)
    targets = [n.target for n in sch.mod.graph.nodes if n.op == "call_module"]
    assert targets == ["fc1._schedlang_sync_bwd_post_0", "act", "fc2", ]
    assert isinstance(sch.mod.fc1._schedlang_sync_bwd_post_0, schedlang.distributed.sync_ops.SyncOp)
    x = torch.randn(5, 12)
    torch.testing.assert_close(_fwd_bwd(sch.mod, x), _fwd_bwd(model, x))


def test_retracing_a_traced_module_flattens_it():
    model = Stack().eval()
    sch = schedlang.create_schedule(model)
    sch.trace()
    sch.trace(flatten=True)
    assert not any(isinstance(m, fx.GraphModule) for n, m in sch.mod.named_modules() if n)
    x = torch.randn(4, 12)
    torch.testing.assert_close(sch.mod(x), model(x))


class _SwishMLP(nn.Module):
    """A drop-in replacement for the tests' MLP."""

    def __init__(self, mlp):
        super().__init__()
        self.fc1, self.fc2 = mlp.fc1, mlp.fc2

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(h))


def test_replaced_modules_are_traced_as_they_are_now():
    model = Stack().eval()
    sch = schedlang.create_schedule(model)
    sch["layers.0.mlp"].replace(_SwishMLP(sch["layers.0.mlp"].mod))
    sch.trace()
    assert "sigmoid" in sch["layers.0.mlp"].mod.code
    assert [[n.name for _, n in sg] for sg in sch.find(lambda h: h * torch.sigmoid(h))] == [["sigmoid", "mul"]]
    x = torch.randn(3, 12)
    expected = model.head(model.layers[1](x + model.layers[0].drop(
        model.layers[0].mlp.fc2(torch.nn.functional.silu(model.layers[0].mlp.fc1(model.layers[0].norm(x)))))))
    torch.testing.assert_close(sch.mod(x), expected)


def test_a_traced_graph_with_functional_dropout_follows_the_training_mode():
    import torch.nn.functional as F

    class Attention(nn.Module):  # dropout on the weights as transformers' eager attention writes it
        def __init__(self):
            super().__init__()
            self.qk = nn.Linear(13, 13)

        def forward(self, x):
            weights = F.dropout(torch.softmax(self.qk(x) @ x.transpose(-1, -2), dim=-1), 0.3, self.training)
            return weights @ x

    model = Attention()  # modules start in training mode
    sch = schedlang.create_schedule(model)
    sch.trace()
    x = torch.randn(2, 7, 13)
    torch.manual_seed(0)
    expected = model(x)
    torch.manual_seed(0)
    torch.testing.assert_close(sch.mod(x), expected, rtol=1.3e-6, atol=1e-5)
    # eval after a training-mode trace used to keep dropping attention weights, silently
    torch.testing.assert_close(sch.mod.eval()(x), model.eval()(x), rtol=1.3e-6, atol=1e-5)
    replayed = schedlang.replay(sch.plan.to_json(), Attention().train())
    replayed.mod.load_state_dict(model.state_dict())
    torch.testing.assert_close(replayed.mod.eval()(x), model(x), rtol=1.3e-6, atol=1e-5)

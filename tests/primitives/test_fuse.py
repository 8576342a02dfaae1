"""``Schedule.fuse``: vertical fusion of found subgraphs, through every compiler."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import schedlang
from schedlang.distributed.launch import run_distributed
from schedlang.errors import LoweringError, NotTracedError, ScheduleValueError
from schedlang.module_record import module_record
from tests.helpers.devices import on_gpu_when_available
from tests.helpers.models import MLP

COMPILERS = ["eager", "triton", "inductor"]


@pytest.fixture(autouse=True)
def _triton_on_the_gpu_when_there_is_one(request):
    """Generated Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter (no GPU)."""
    params = getattr(request.node, "callspec", None)
    if params and params.params.get("compiler") == "triton":
        with on_gpu_when_available():
            yield
    else:
        yield


def _bias_gelu(x, bias):
    return F.gelu(x + bias)


def _fwd_bwd(module, x, grad_seed=3):
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = module(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed), device="cpu").to(out.device))
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    return out.detach(), x.grad, grads


def _assert_same_numerics(ref_module, new_module, x, **tol):
    ref_out, ref_gx, ref_grads = _fwd_bwd(ref_module, x)
    out, gx, grads = _fwd_bwd(new_module, x)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(gx, ref_gx, **tol)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **tol, msg=lambda m: f"{name}: {m}")


def _fused_mlp(model, compiler):
    sch = schedlang.create_schedule(model)
    sch["fc1"].decompose()
    sch.trace(flatten=True)
    sch.fuse(sch.find(_bias_gelu), compiler=compiler, name="BiasGeLU")
    return sch


@pytest.mark.parametrize("compiler", COMPILERS)
def test_bias_gelu_outputs_and_gradients_match_the_unfused_model(compiler):
    model = MLP(hidden=16, inner=24)
    sch = _fused_mlp(model, compiler)
    fused = sch["BiasGeLU_0"].mod
    assert module_record(fused).fused and not list(fused.parameters())
    assert sch.mod.fc1.bias is not model.fc1.bias and "act" not in dict(sch.mod.named_children())
    assert [n.target for n in sch.mod.graph.nodes if n.op == "call_module"] == ["BiasGeLU_0", "fc2"]
    assert list(sch.mod.state_dict()) == list(model.state_dict())
    for shape in [(7, 13, 16), (4, 16)]:
        _assert_same_numerics(model, sch.mod, torch.randn(*shape), rtol=1e-5, atol=1e-5)


class _Projection(nn.Module):
    """Slapo's attention output block: dense -> dropout -> + residual -> LayerNorm."""

    def __init__(self, hidden=32):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(0.1)
        self.layer_norm = nn.LayerNorm(hidden)

    def forward(self, hidden_states, residual):
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.layer_norm(hidden_states + residual)


def _ln_pattern(x, bias, residual):
    return F.layer_norm(F.dropout(x + bias) + residual, (32,))


@pytest.mark.parametrize("compiler", COMPILERS)
def test_layer_norm_chain_keeps_its_weights_in_place(compiler):
    model = _Projection().eval()
    sch = schedlang.create_schedule(model)
    sch["dense"].decompose()
    sch.trace(flatten=True)
    found = sch.find(_ln_pattern)
    assert [n.name for _, n in found[0]] == ["add", "dropout", "add_1", "layer_norm"]
    sch.fuse(found, compiler=compiler, name="FusedLayerNorm")
    sch.mod.eval()
    fused = sch["FusedLayerNorm_0"].mod
    assert not list(fused.parameters())  # LayerNorm's weight and bias are inputs
    assert sch.mod.layer_norm.weight is not None and list(sch.mod.state_dict()) == list(model.state_dict())
    x, r = torch.randn(5, 7, 32), torch.randn(5, 7, 32)
    xr, rr = x.clone().requires_grad_(), r.clone().requires_grad_()
    xs, rs = x.clone().requires_grad_(), r.clone().requires_grad_()
    ref, out = model(xr, rr), sch.mod(xs, rs)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    out.backward(grad)
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(xs.grad, xr.grad, **tol)
    torch.testing.assert_close(rs.grad, rr.grad, **tol)
    for name, p in sch.mod.named_parameters():
        torch.testing.assert_close(p.grad, model.get_parameter(name).grad, **tol)


class _TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = MLP(8, 12), MLP(8, 12)

    def forward(self, x):
        return self.b(self.a(x))


def test_several_subgraphs_get_numbered_modules_and_the_plan_replays():
    model = _TwoBlocks()
    sch = schedlang.create_schedule(model)
    sch["a.fc1"].decompose()
    sch["b.fc1"].decompose()
    sch.trace(flatten=True)
    found = sch.find(_bias_gelu)
    assert len(found) == 2
    sch.fuse(found, compiler="eager", name="BiasGeLU")
    assert {"BiasGeLU_0", "BiasGeLU_1"} <= set(dict(sch.mod.named_children()))
    assert "2 subgraphs [add+a_act, add_1+b_act]" in str(sch.plan)
    x = torch.randn(6, 8)
    _assert_same_numerics(model, sch.mod, x)
    replayed = schedlang.replay(sch.plan.to_json(), _TwoBlocks())
    assert replayed.mod.code == sch.mod.code
    fresh = copy.deepcopy(model)
    replayed_same = schedlang.replay(sch.plan, fresh)  # in-process plan with node objects
    _assert_same_numerics(model, replayed_same.mod, x)


def test_fusing_inside_a_hierarchically_traced_child():
    model = _TwoBlocks()
    sch = schedlang.create_schedule(model)
    sch["b.fc1"].decompose()
    sch["b"].trace(flatten=True)
    sch.trace()
    found = sch.find(_bias_gelu)
    assert [sg[0][0] for sg in found] == ["b"]
    sch.fuse(found, compiler="eager", name="BiasGeLU")
    assert "BiasGeLU_0" in dict(sch["b"].mod.named_children())
    _assert_same_numerics(model, sch.mod, torch.randn(3, 8))


def test_torchscript_scripts_the_subgraph():
    model = MLP(hidden=8, inner=8)
    sch = schedlang.create_schedule(model)
    sch["fc1"].decompose()
    sch.trace(flatten=True)
    sch.fuse(sch.find(_bias_gelu), compiler="TorchScript", name="BiasGeLU")
    assert sch.plan[-1].args["compiler"] == "torchscript"
    assert isinstance(sch["BiasGeLU_0"].mod, torch.jit.ScriptModule)
    _assert_same_numerics(model, sch.mod, torch.randn(3, 8))


class _Cycle(nn.Module):
    def forward(self, x):
        a = torch.tanh(x)
        b = torch.sigmoid(a)
        return torch.exp(a * b)


def test_fuse_errors_leave_the_module_as_it_was():
    sch = schedlang.create_schedule(_Cycle())
    with pytest.raises(NotTracedError, match=r"^<root>: fuse needs a traced module, but this is _Cycle; call "
                                             r"sch\.trace\(\) first$"):
        sch.fuse([("", "tanh")], compiler="eager")
    sch.trace()
    code = sch.mod.code
    with pytest.raises(ScheduleValueError, match=r"^fuse: unknown compiler 'nvfuser': valid compilers are 'triton', "
                                                 r"'inductor', 'eager'"):
        sch.fuse(sch.find(lambda x: torch.tanh(x)), compiler="nvfuser")
    with pytest.raises(ScheduleValueError, match=r"^<root>: fuse name must be a Python identifier \(it names the new "
                                                 r"submodule\), got 'my kernel'$"):
        sch.fuse(sch.find(lambda x: torch.tanh(x)), compiler="eager", name="my kernel")
    with pytest.raises(ScheduleValueError, match=r"^<root>: fuse of subgraph 0 would create a cycle: 'tanh' feeds "
                                                 r"'sigmoid' outside the subgraph, which feeds 'mul' inside it"):
        sch.fuse([("", "tanh"), ("", "mul")], compiler="eager")
    assert sch.mod.code == code and len(sch.plan) == 1


class _Sorts(nn.Module):
    def forward(self, x):
        return torch.sort(torch.tanh(x), dim=-1).values * 2


def test_an_unlowerable_subgraph_raises_lowering_error_and_changes_nothing():
    model = _Sorts()
    sch = schedlang.create_schedule(model)
    sch.trace()
    code = sch.mod.code
    found = [[(p, n) for p, n in [("", node) for node in sch.mod.graph.nodes if node.op == "call_function"]]]
    with pytest.raises(LoweringError):
        sch.fuse(found, compiler="triton", name="Sorted")
    assert sch.mod.code == code and "Sorted_0" not in dict(sch.mod.named_children())
    sch.fuse(found, compiler="eager", name="Sorted")  # any op runs eagerly
    x = torch.randn(4, 9)
    torch.testing.assert_close(sch.mod(x), model(x))


def test_a_module_with_a_sync_point_cannot_be_fused_away():
    model = MLP(hidden=8, inner=8)
    sch = schedlang.create_schedule(model)
    sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch.trace(flatten=True)
    found = [[("", n) for n in sch.mod.graph.nodes if n.op == "call_module"]]  # act and fc2
    with pytest.raises(ScheduleValueError, match=r"^<root>: cannot fuse 'fc2': module 'fc2' \(Linear\) has hooks or "
                                                 r"sync points, which the new module would drop; leave it out"):
        sch.fuse(found, compiler="eager")


# ------------------------------------------------------------------ tensor parallelism + fusion


def _tp_fused_mlp(rank, world):
    import os

    if torch.cuda.is_available():
        torch.set_default_device("cuda")  # gloo moves CUDA tensors through the host
    else:
        os.environ["TRITON_INTERPRET"] = "1"
    torch.manual_seed(0)  # same model on every rank
    model = MLP(hidden=10, inner=14)
    x = torch.randn(3, 5, 10)
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[x]) as verify:
        sch["fc1"].shard("weight", axis=0)
        sch["fc1"].shard("bias", axis=0)
        sch["fc2"].shard("weight", axis=1)
        sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        sch["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        sch["fc1"].decompose()
        sch.trace(flatten=True)
        sch.fuse(sch.find(_bias_gelu), compiler="triton", name="BiasGeLU")
    assert verify.report.passed
    # direct check as well: the local shard of every gradient against the full model
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, out = model(xr), sch.mod(xs)
    ref.pow(2).sum().backward()
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-5, atol=1e-5)
    s = slice(rank * 7, (rank + 1) * 7)
    torch.testing.assert_close(sch.mod.fc1.bias.grad, model.fc1.bias.grad[s], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sch.mod.fc1.weight.grad, model.fc1.weight.grad[s], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sch.mod.fc2.weight.grad, model.fc2.weight.grad[:, s], rtol=1e-5, atol=1e-5)
    return [n.target for n in sch.mod.graph.nodes if n.op == "call_module"]


def test_tensor_parallel_mlp_traced_and_fused_matches_the_single_device_model():
    calls = run_distributed(_tp_fused_mlp, world_size=2, timeout=240)
    assert calls == [["fc1._schedlang_sync_bwd_post_0", "BiasGeLU_0", "fc2._schedlang_sync_fwd_post_0"]] * 2

"""The hierarchy-keeping tracer: structure, numerics, what survives tracing, and its errors."""

import copy
import io

import pytest

import schedlang
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from schedlang.errors import TraceError
from schedlang.graph import PH, TracedModule, register_leaf_function, trace_module
from schedlang.graph.pattern import find_subgraphs
from schedlang.module_record import shard_specs, update_record
from tests.helpers.models import MLP, Stack


def _check_fwd_bwd(reference: nn.Module, traced: nn.Module, *inputs, rtol=1.3e-6, atol=1e-5):
    ref_in = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    new_in = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    ref_out, new_out = reference(*ref_in), traced(*new_in)
    torch.testing.assert_close(new_out, ref_out, rtol=rtol, atol=atol)
    grad = torch.randn_like(ref_out)
    ref_out.backward(grad)
    new_out.backward(grad)
    for a, b in zip(new_in, ref_in):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=atol)


def test_hierarchy_is_kept_with_one_graph_per_traced_child():
    model = Stack(hidden=12, inner=20).eval()
    gm = trace_module(model)
    assert isinstance(gm, TracedModule)
    assert type(gm.layers) is nn.ModuleList and len(gm.layers) == 2
    assert isinstance(gm.layers[0], fx.GraphModule) and isinstance(gm.layers[0].mlp, fx.GraphModule)
    # leaves are the very same modules, so parameters keep their identity and names
    assert gm.layers[0].mlp.fc1 is model.layers[0].mlp.fc1
    assert list(gm.state_dict()) == list(model.state_dict())
    assert {n: id(p) for n, p in gm.named_parameters()} == {n: id(p) for n, p in model.named_parameters()}
    assert [n for n, _ in gm.named_children()] == ["layers", "head"]
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert targets == ["layers.0", "layers.1", "head"]
    for shape in [(3, 12), (7, 13, 12), (1000, 12)]:
        _check_fwd_bwd(model, gm, torch.randn(*shape))


def test_flatten_inlines_children_into_one_graph():
    model = Stack(hidden=12, inner=20).eval()
    gm = trace_module(model, flatten=True)
    assert not any(isinstance(m, fx.GraphModule) for _, m in gm.named_modules() if m is not gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert "layers.0.mlp.fc1" in targets and "layers.1.mlp.act" in targets
    assert list(gm.state_dict()) == list(model.state_dict())
    _check_fwd_bwd(model, gm, torch.randn(7, 13, 12))


def test_recursive_false_keeps_children_as_calls():
    model = Stack().eval()
    gm = trace_module(model, recursive=False)
    assert gm.layers[0] is model.layers[0] and not isinstance(gm.layers[0], fx.GraphModule)
    _check_fwd_bwd(model, gm, torch.randn(4, 12))


def test_leaf_modules_by_type_and_by_name():
    model = Stack().eval()
    gm = trace_module(model, leaf_modules=[MLP])
    assert gm.layers[0].mlp is model.layers[0].mlp
    gm = trace_module(model, flatten=True, leaf_modules=["layers.1.mlp"])
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert "layers.1.mlp" in targets and "layers.0.mlp.fc1" in targets
    _check_fwd_bwd(model, gm, torch.randn(5, 12))


class _WithState(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(6, 6)
        self.unused = nn.Linear(6, 6)
        self.spare = nn.Parameter(torch.randn(3))
        self.register_buffer("scale", torch.tensor(2.0), persistent=False)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        return self.used(x) * self.scale


def test_every_parameter_and_buffer_keeps_its_name_and_persistence():
    model = _WithState()
    gm = trace_module(model)
    assert list(gm.state_dict()) == list(model.state_dict())
    assert "scale" not in gm.state_dict() and gm.scale is model.scale
    assert gm.spare is model.spare and gm.unused is model.unused
    gm.load_state_dict(model.state_dict())
    _check_fwd_bwd(model, gm, torch.randn(7, 6))


def test_forward_hooks_move_to_the_traced_module():
    model = Stack().eval()
    calls = []
    model.register_forward_hook(lambda m, args, out: out * 3)
    model.layers[0].register_forward_pre_hook(lambda m, args: (args[0] + 1,))
    model.layers[1].register_forward_hook(lambda m, args, out: calls.append(out.shape))
    gm = trace_module(model)
    x = torch.randn(4, 12)
    torch.testing.assert_close(gm(x), model(x))
    assert len(gm._forward_hooks) == 1 and len(gm.layers[0]._forward_pre_hooks) == 1
    assert len(calls) == 2  # the hook of layers.1 ran for the traced module as for the original


def test_schedlang_attributes_and_plain_attributes_of_the_root_are_kept():
    model = MLP()
    model._schedlang_note = "kept"
    model.hidden_size = 12
    gm = trace_module(model)
    assert gm._schedlang_note == "kept" and gm.hidden_size == 12
    assert gm._schedlang_traced_from.endswith("MLP")


class _Decomposed(nn.Module):
    """A module that uses its weights directly, so flattening its parent inlines it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return F.linear(x, self.weight) + self.bias


def test_shard_records_are_carried_to_the_module_that_now_owns_the_parameters():
    model = nn.Sequential(_Decomposed(), nn.GELU())
    update_record(model[0], shards={"weight": "w", "bias": "b", "gone": "x"})
    gm = trace_module(model, flatten=True)
    owner = gm.get_submodule("0")
    assert type(owner) is nn.Module and owner.weight is model[0].weight
    assert shard_specs(owner) == {"weight": "w", "bias": "b"}
    _check_fwd_bwd(model, gm, torch.randn(3, 8))


def test_deepcopy_keeps_hooks_containers_and_unused_state():
    model = _WithState()
    model.register_forward_hook(lambda m, a, out: out + 1)
    gm = trace_module(nn.Sequential(model, nn.ReLU()))
    clone = copy.deepcopy(gm)
    assert isinstance(clone, TracedModule)
    assert list(clone.state_dict()) == list(gm.state_dict())
    assert len(clone.get_submodule("0")._forward_hooks) == 1
    assert clone.get_submodule("0.used").weight is not gm.get_submodule("0.used").weight
    x = torch.randn(5, 6)
    torch.testing.assert_close(clone(x), gm(x))


def test_pickling_keeps_hooks_and_unused_state_without_tracing_again():
    import io

    model = _WithState()
    model.register_forward_hook(_add_one)
    gm = trace_module(nn.Sequential(model, nn.ReLU()))
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, TracedModule) and loaded.code == gm.code
    assert list(loaded.state_dict()) == list(gm.state_dict())
    assert len(loaded.get_submodule("0")._forward_hooks) == 1
    x = torch.randn(5, 6)
    torch.testing.assert_close(loaded(x), gm(x))


def _add_one(module, args, out):
    return out + 1


class _ShapeBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        heads = (*x.shape[:-1], 4, -1)        # needs the rank of x
        y = self.proj(x).view(heads).transpose(-2, -3)
        if y.shape[-1] > 2:                   # needs a size
            y = y * 2
        return y.transpose(-2, -3).reshape(x.shape)


def test_shape_dependent_python_is_answered_by_example_inputs():
    model = _ShapeBranches()
    gm = trace_module(model, concrete_args={"x": torch.randn(2, 5, 16)})
    assert "view" in gm.code and "mul" in gm.code
    for shape in [(2, 5, 16), (3, 7, 16)]:  # the graph keeps shapes symbolic
        _check_fwd_bwd(model, gm, torch.randn(*shape))


def test_shape_dependent_python_without_an_example_fails_loudly():
    with pytest.raises(TraceError, match=r"^<root>: 'getitem = getitem\(getattr_1, slice\(None, -1, None\)\)' is "
                                         r"iterated over \(for / \* unpacking\), so its value must be known while "
                                         r"tracing, but no example input reaches it; pass example tensors for 'x' "
                                         r"in concrete_args \(e\.g\. concrete_args=\{'x': <example tensor>\}\)"):
        trace_module(_ShapeBranches())


class _DataBranch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


def test_data_dependent_control_flow_names_module_and_remedy():
    with pytest.raises(TraceError, match=r"^inner\.1: the condition 'gt = gt\(sum_1, 0\)' depends on tensor data, "
                                         r"which symbolic tracing cannot know; mark the module as a leaf"):
        trace_module(nn.Sequential(nn.Linear(3, 3), _DataBranch()), concrete_args={"input": torch.randn(2, 3)},
                     path="inner")


class _Optional(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale=None, mode="plain"):
        y = self.lin(x)
        if scale is not None:
            y = y * scale
        return y + 1 if mode == "plain" else y


def test_specialized_arguments_are_guarded():
    model = _Optional()
    gm = trace_module(model, path="blk")
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), model(x))
    torch.testing.assert_close(gm(x, None, "plain"), model(x))
    with pytest.raises(TraceError, match=r"^blk: the graph was traced with scale=None and cannot take scale=a tensor "
                                         r"of shape \(3, 4\); trace the module again with concrete_args="):
        gm(x, torch.randn(3, 4))
    with pytest.raises(TraceError, match=r"traced with mode='plain' and cannot take mode='other'"):
        gm(x, mode="other")


class _FunctionalDropout(nn.Module):
    """Dropout written as transformers writes it: the mode is read in forward, not held by a leaf module."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(13, 7)

    def forward(self, x):
        return F.dropout(self.proj(x), p=0.5, training=self.training)


class _BlockWithFunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _FunctionalDropout()
        self.head = nn.Linear(7, 7)

    def forward(self, x):
        return self.head(self.inner(x))


def _same_in_both_modes(model: nn.Module, traced: nn.Module, *inputs) -> None:
    """The traced module gives the model's outputs and gradients in training mode (same seed) and in eval mode."""
    for training in (True, False, True):
        model.train(training)
        traced.train(training)
        torch.manual_seed(1)
        ref_in = [x.clone().requires_grad_() for x in inputs]
        ref = model(*ref_in)
        torch.manual_seed(1)
        new_in = [x.clone().requires_grad_() for x in inputs]
        out = traced(*new_in)
        torch.testing.assert_close(out, ref, rtol=1.3e-6, atol=1e-5)
        out.sum().backward()
        ref.sum().backward()
        for a, b in zip(new_in, ref_in):
            torch.testing.assert_close(a.grad, b.grad, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("traced_training", [True, False])
def test_functional_dropout_in_a_traced_graph_follows_the_training_mode(traced_training, flatten):
    model = _BlockWithFunctionalDropout().train(traced_training)
    traced = trace_module(model, flatten=flatten)
    x = torch.randn(5, 13)
    # the graph froze the flag it was traced with: eval after a training-mode trace kept dropping, silently
    owner = traced if flatten else traced.inner
    dropouts = [m for m in owner.children() if type(m) is nn.Dropout]
    assert len(dropouts) == 1 and dropouts[0].p == 0.5 and "dropout(" not in owner.code
    _same_in_both_modes(model, traced, x)
    assert not any(m._forward_pre_hooks for m in traced.modules())
    _same_in_both_modes(model, copy.deepcopy(traced), x)
    buffer = io.BytesIO()
    torch.save(traced, buffer)
    buffer.seek(0)
    _same_in_both_modes(model, torch.load(buffer, weights_only=False), x)
    _same_in_both_modes(model, trace_module(traced, flatten=True), x)  # traced again: the module stays a call


@pytest.mark.parametrize("functional",
                         [F.dropout, F.dropout1d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout])
def test_each_dropout_function_becomes_its_module(functional):
    class Drop(nn.Module):
        def forward(self, x):
            if functional is torch.dropout:
                return torch.dropout(x, 0.25, self.training)
            return functional(x, 0.25, self.training)

    model = Drop().train()
    traced = trace_module(model)
    assert [type(m).__name__ for m in traced.children()] == [
        {F.dropout: "Dropout", torch.dropout: "Dropout", F.dropout1d: "Dropout1d", F.alpha_dropout: "AlphaDropout",
         F.feature_alpha_dropout: "FeatureAlphaDropout"}[functional]]
    _same_in_both_modes(model, traced, torch.randn(3, 6, 11))


def _noisy(x, module, scale):
    """A kernel in a library: reads the module's training flag from the snapshot it is given."""
    return x + scale * torch.randn_like(x) if module.training else x * (1.0 + scale)


register_leaf_function(_noisy)


def test_a_leaf_call_given_other_constants_per_mode_follows_the_mode():
    class Noisy(nn.Module):  # as transformers calls its attention kernels: dropout=p if self.training else 0.0
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(9, 9)

        def forward(self, x):
            return _noisy(self.proj(x), self, scale=0.5 if self.training else 0.25)

    for traced_training in (True, False):
        model = Noisy().train(traced_training)
        traced = trace_module(model)
        calls = [m for m in traced.children() if isinstance(m, schedlang.graph.ModeDependentCall)]
        assert len(calls) == 1 and calls[0].target is _noisy
        _same_in_both_modes(model, traced, torch.randn(4, 9))
        _same_in_both_modes(model, copy.deepcopy(traced), torch.randn(4, 9))


def test_attention_with_dropout_only_in_training_follows_the_mode_and_is_found_as_that_call():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3 if self.training else 0.0, is_causal=True)

    model = Attention().train()
    traced = trace_module(model)
    (name, call), = [(n, m) for n, m in traced.named_children() if isinstance(m, schedlang.graph.ModeDependentCall)]
    assert call.target is F.scaled_dot_product_attention
    _same_in_both_modes(model, traced, torch.randn(2, 5, 16))

    def pattern(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)

    traced.train()  # matched as the call it makes in the mode the module is in
    assert [[n.target for _, n in m] for m in find_subgraphs(traced, pattern)] == [[name]]
    traced.eval()
    assert find_subgraphs(traced, pattern) == []
    assert len(find_subgraphs(traced, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))) == 1


class _TrainingOnlyNoise(nn.Module):
    """A branch on self.training that adds an operation: the graphs of the two modes differ in their nodes."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(13, 7)

    def forward(self, x):
        h = self.proj(x)
        if self.training:
            h = h * 2.0
        return h


class _BlockWithTrainingOnlyNoise(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _TrainingOnlyNoise()
        self.head = nn.Linear(7, 7)

    def forward(self, x):
        return self.head(self.inner(x))


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("traced_training", [True, False])
def test_a_graph_with_a_branch_on_the_training_mode_runs_only_in_the_traced_mode(traced_training, flatten):
    model = _BlockWithTrainingOnlyNoise().train(traced_training)
    traced = trace_module(model, flatten=flatten)
    x = torch.randn(5, 13)
    torch.testing.assert_close(traced(x), model(x), rtol=1.3e-6, atol=1e-5)
    traced.train(not traced_training)
    where = "<root>" if flatten else "inner"
    traced_mode, other_mode = ("training", "eval") if traced_training else ("eval", "training")
    with pytest.raises(TraceError, match=rf"{where}: this graph was traced in {traced_mode} mode .* cannot run in "
                                        rf"{other_mode} mode"):
        traced(x)
    traced.train(traced_training)
    assert copy.deepcopy(traced)(x).shape == (5, 7)  # a copy keeps the guard and still runs in the traced mode
    copied = copy.deepcopy(traced).train(not traced_training)
    with pytest.raises(TraceError, match="cannot run in"):
        copied(x)


def test_a_graph_that_reads_no_training_mode_runs_in_both_modes():
    model = Stack().train()
    traced = trace_module(model)
    x = torch.randn(7, 13, 12)
    traced.eval()
    model.eval()
    torch.testing.assert_close(traced(x), model(x), rtol=1.3e-6, atol=1e-5)
    assert not any(m._forward_pre_hooks for m in traced.modules())


def test_dropout_with_zero_probability_does_not_tie_the_graph_to_a_mode():
    class ZeroDropout(nn.Module):  # LLaMA's attention: p=0.0, training=self.training
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(13, 7)

        def forward(self, x):
            return F.dropout(self.proj(x), p=0.0, training=self.training)

    model = ZeroDropout().train()
    traced = trace_module(model)
    x = torch.randn(5, 13)
    traced.eval()
    torch.testing.assert_close(traced(x), model.eval()(x), rtol=1.3e-6, atol=1e-5)
    assert not traced._forward_pre_hooks


def test_placeholder_makes_an_optional_argument_an_input():
    model = _Optional()
    gm = trace_module(model, concrete_args={"scale": PH})
    x, s = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(gm(x, s), model(x, s))


def _clipped(x, limit):
    return x.clamp(max=limit) if bool((x > limit).any()) else x


register_leaf_function(_clipped)


class _UsesLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x):
        return _clipped(self.lin(x), 0.5) * 2


def test_leaf_functions_become_one_node():
    model = _UsesLeaf()
    gm = trace_module(model)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _clipped]
    assert len(calls) == 1
    _check_fwd_bwd(model, gm, torch.randn(7, 5))


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Optional()

    def forward(self, x):
        return self.inner(x, mode="plain") + self.inner(x, mode="other")


def test_a_child_called_with_different_constants_cannot_share_a_graph():
    with pytest.raises(TraceError, match=r"^inner: the module is called more than once with different non-tensor "
                                         r"arguments, so one graph cannot serve every call; keep it as a leaf"):
        trace_module(_Twice())
    gm = trace_module(_Twice(), leaf_modules=["inner"])
    assert not isinstance(gm.inner, fx.GraphModule)


def test_instance_level_forward_is_refused():
    model = nn.Linear(3, 3)
    model.forward = lambda x: x
    with pytest.raises(TraceError, match=r"^lin: Linear has a forward set on the instance, which FX cannot trace"):
        trace_module(model, path="lin")


class _Broken(nn.Module):
    def forward(self, x):
        raise ValueError("this module only runs eagerly")


def test_failures_name_the_submodule_and_chain_the_cause():
    model = nn.Sequential(nn.Linear(2, 2), _Broken())
    with pytest.raises(TraceError, match=r"^net\.1: cannot trace _Broken: ValueError: this module only runs "
                                         r"eagerly; keep the failing submodule whole with leaf_modules=\[\.\.\.\], or "
                                         r"pass concrete_args$") as info:
        trace_module(model, path="net", concrete_args={"input": torch.randn(2, 2)})
    assert isinstance(info.value.__cause__, ValueError)


def test_the_traced_module_is_not_changed():
    from tests.helpers.models import assert_unchanged, state_snapshot

    model = Stack()
    model.layers[0].register_forward_hook(lambda m, a, o: o)
    before = state_snapshot(model)
    trace_module(model)
    trace_module(model, flatten=True)
    assert_unchanged(model, before)


def test_duck_typing_probes_see_a_tensor_not_a_proxy():
    """Framework-detection helpers (e.g. with JAX installed) probe ``hasattr(x, "jax")``."""

    class Probing(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if hasattr(x, "jax") or hasattr(x, "not_a_tensor_attribute"):
                x = x.jax()
            return self.lin(x)

    model = Probing()
    sch = schedlang.create_schedule(model)
    sch.trace(concrete_args={"x": torch.randn(3, 4)})  # a tensor here is an example input
    assert "jax" not in sch.mod.code
    x = torch.randn(3, 4)
    torch.testing.assert_close(sch.mod(x), model(x))


class _ShapeBranch(nn.Module):
    """Python control flow on what tracing knows from the example: a shape, a dtype, a row count."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x):
        h = self.proj(x)
        if h.size(1) > 4:  # e.g. a chunked path for long sequences
            h = h * 0.5
        if h.dtype == torch.float16:
            h = h.clamp(-100, 100)
        return torch.stack([row.sum(0) for row in h])  # one op per row: unrolled to the traced batch


def test_a_branch_taken_while_tracing_is_checked_when_the_graph_runs():
    model = _ShapeBranch()
    traced = trace_module(model, concrete_args={"x": torch.randn(3, 7, 6)})
    _check_fwd_bwd(model, traced, torch.randn(3, 9, 6))  # the same branches at another length
    # the graph used to take the traced branch for any input, silently
    with pytest.raises(TraceError, match=r"^<root>: the graph was traced where 'proj\.size\(1\) > 4' was True, and "
                                         r"now it is False; the graph holds only the branch taken while tracing"):
        traced(torch.randn(3, 2, 6))
    with pytest.raises(TraceError, match=r"^<root>: the graph was traced where len\(proj \* 0\.5\) was 3, and now "
                                         r"it is 5; the graph was unrolled to the traced length"):
        traced(torch.randn(5, 7, 6))
    with pytest.raises(TraceError, match=r"'\(proj \* 0\.5\)\.dtype == torch\.float16' was False, and now it is True"):
        traced.half()(torch.randn(3, 7, 6, dtype=torch.float16))
    traced.float()
    again = trace_module(model, concrete_args={"x": torch.randn(5, 2, 6)})  # the way out the message gives
    _check_fwd_bwd(model, again, torch.randn(5, 2, 6))
    try:
        for dynamic in (False, True):  # torch.compile keeps the checks (as guards of its own)
            compiled = torch.compile(traced, backend="eager", dynamic=dynamic)
            torch.testing.assert_close(compiled(x := torch.randn(3, 9, 6)), model(x))
            with pytest.raises(TraceError, match="was True, and now it is False"):
                compiled(torch.randn(3, 2, 6))
    finally:
        torch._dynamo.reset()  # drop the compiled frames and their symbolic shapes


def test_a_shape_unpacked_adds_no_check():
    # a shape's length is its rank: a graph on the wrong rank fails in its own ops, so no check is added
    traced = trace_module(Stack().eval())
    assert not any(n.target.__name__.startswith("check_traced") for m in traced.modules()
                   if isinstance(m, fx.GraphModule) for n in m.graph.nodes if n.op == "call_function")


class _OnesOfTracedSizes(nn.Module):
    """Builds a mask as OPT's decoder does: torch.ones(batch, seq) with the sizes read off the input."""

    def forward(self, x):
        mask = torch.ones(x.shape[0], x.shape[1], device=x.device, dtype=x.dtype)
        noise = torch.zeros(x.shape[0], x.shape[1], x.shape[2]) + torch.empty(0).new_zeros(())
        return x * mask.cumsum(-1).unsqueeze(-1) + noise


def test_factories_given_traced_sizes_one_by_one_trace_and_rerun_on_other_shapes():
    model = _OnesOfTracedSizes()
    gm = trace_module(model, concrete_args={"x": torch.randn(2, 3, 4)})
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ones in targets and torch.zeros in targets
    assert torch.ones(2, 3).shape == (2, 3)  # torch itself is left as it was
    for shape in [(2, 3, 4), (5, 7, 4)]:
        x = torch.randn(shape)
        torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)

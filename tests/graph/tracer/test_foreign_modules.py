"""Modules a traced forward calls but does not own (a global, a closure, an unregistered attribute): traced
through when their forward traces and depends on no state or mode of theirs, one opaque call otherwise."""

import contextvars
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from schedlang.errors import TraceError
from schedlang.graph import trace_module
from schedlang.graph.pattern import find_subgraphs
from schedlang.graph.tracer.foreign_modules import OpaqueModuleCall

TOLERANCES = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
HIDDEN = 10  # even (the rotation swaps halves), and no power of two


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Rotate(nn.Module):
    """A function made a module, as transformers' kernel-hub decorator does with ``apply_rotary_pos_emb``."""

    def forward(self, x, cos, sin):
        return _rotate(x, cos, sin)


_GLOBAL_ROTATE = _Rotate()


class _CallsGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, cos, sin):
        return _GLOBAL_ROTATE(self.proj(x), cos, sin)


def _calls_closure():
    rotate = _Rotate()

    class _CallsClosure(_CallsGlobal):
        def forward(self, x, cos, sin):
            return rotate(self.proj(x), cos, sin)

    return _CallsClosure()


class _CallsUnregisteredAttribute(_CallsGlobal):
    def __init__(self):
        super().__init__()
        self.__dict__["rotate"] = _Rotate()  # kept out of _modules, so no submodule

    def forward(self, x, cos, sin):
        return self.rotate(self.proj(x), cos, sin)


# the kernel hub's dispatch: a global module routes each call to the calling module's private copy
_PRIVATE_COPY = contextvars.ContextVar("private_copy", default=None)


class _Router(nn.Module):
    def forward(self, *args):
        private = _PRIVATE_COPY.get()
        return private(*args) if private is not None else _rotate(*args)


_ROUTER = _Router()


class _CallsThroughRouter(_CallsGlobal):
    def __init__(self):
        super().__init__()
        self.__dict__["_private"] = {"rotate": _Rotate()}

    def forward(self, x, cos, sin):
        token = _PRIVATE_COPY.set(self._private["rotate"])
        try:
            return _ROUTER(self.proj(x), cos, sin)
        finally:
            _PRIVATE_COPY.reset(token)


HOLDERS = {"global": _CallsGlobal, "closure": _calls_closure, "attribute": _CallsUnregisteredAttribute,
           "router": _CallsThroughRouter}


def _inputs(dtype, batch=3, seq=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, HIDDEN, generator=g).to(dtype)
    angle = torch.randn(seq, HIDDEN, generator=g)
    return x, angle.cos().to(dtype), angle.sin().to(dtype)


def _check_fwd_bwd(reference, traced, inputs, dtype):
    tol = TOLERANCES[dtype]
    ref_in = [t.clone().requires_grad_() for t in inputs]
    new_in = [t.clone().requires_grad_() for t in inputs]
    ref_out, new_out = reference(*ref_in), traced(*new_in)
    torch.testing.assert_close(new_out, ref_out, **tol)
    grad = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref_out.backward(grad)
    new_out.backward(grad)
    for a, b in zip(new_in, ref_in):
        torch.testing.assert_close(a.grad, b.grad, **tol)
    ref_params = dict(reference.named_parameters())
    for name, p in traced.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("holder", sorted(HOLDERS))
def test_a_stateless_module_not_owned_is_traced_through(holder, training, dtype):
    model = HOLDERS[holder]().to(dtype).train(training)
    traced = trace_module(model, concrete_args=dict(zip(("x", "cos", "sin"), _inputs(dtype))))
    targets = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert torch.cat in targets and not any(isinstance(t, OpaqueModuleCall) for t in targets)
    assert list(traced.state_dict()) == list(model.state_dict())
    for batch, seq in [(3, 7), (2, 13)]:  # other shapes than traced: the sizes stay symbolic
        _check_fwd_bwd(model, traced, _inputs(dtype, batch, seq, seed=batch), dtype)
    traced.train(not training)  # no mode was read: the graph serves the other one as well
    model.train(not training)
    _check_fwd_bwd(model, traced, _inputs(dtype), dtype)


def test_operations_of_a_module_not_owned_can_be_found():
    traced = trace_module(_CallsGlobal(), concrete_args=dict(zip(("x", "cos", "sin"), _inputs(torch.float32))))

    def rotation(x, cos, rotated, sin):
        return x * cos + torch.cat((-rotated, x), dim=-1) * sin

    (match,) = find_subgraphs(traced, lambda upper, lower: torch.cat((-upper, lower), dim=-1))
    assert [n.target for _, n in match] == [__import__("operator").neg, torch.cat]


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, x):
        return x * self.weight


_GLOBAL_SCALE = _Scale()


class _CallsStatefulGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return _GLOBAL_SCALE(self.proj(x)).relu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_module_not_owned_with_parameters_stays_one_call_and_its_gradients_reach_it(dtype):
    model = _CallsStatefulGlobal().to(dtype)
    scale = copy.deepcopy(_GLOBAL_SCALE)  # the global itself stays in float32 for the other tests
    _GLOBAL_SCALE.to(dtype)
    try:
        traced = trace_module(model)
        (call,) = [n.target for n in traced.graph.nodes if isinstance(n.target, OpaqueModuleCall)]
        assert call.module is _GLOBAL_SCALE
        assert list(traced.state_dict()) == list(model.state_dict())  # its weight is no state of the traced one
        x = torch.randn(4, 5, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
        ref_out = model(x)
        ref_grad, = torch.autograd.grad(ref_out.sum(), _GLOBAL_SCALE.weight)
        out = traced(x)
        grad, = torch.autograd.grad(out.sum(), _GLOBAL_SCALE.weight)
        torch.testing.assert_close(out, ref_out, **TOLERANCES[dtype])
        torch.testing.assert_close(grad, ref_grad, **TOLERANCES[dtype])
        assert copy.deepcopy(traced).graph.nodes and \
            [n.target for n in copy.deepcopy(traced).graph.nodes if isinstance(n.target, OpaqueModuleCall)][0].module \
            is _GLOBAL_SCALE  # a copy calls the same global, as a copy of the eager module does
    finally:
        _GLOBAL_SCALE.load_state_dict(scale.state_dict())
        _GLOBAL_SCALE.to(torch.float32)


class _SignGate(nn.Module):
    """Branches on tensor data: its forward does not trace."""

    def forward(self, x):
        return x * 2 if x.sum() > 0 else -x


_GLOBAL_GATE = _SignGate()


class _CallsUntraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return _GLOBAL_GATE(self.proj(x) + 1).exp()


def test_a_module_not_owned_whose_forward_does_not_trace_is_one_call_and_leaves_no_partial_trace():
    model = _CallsUntraceable()
    traced = trace_module(model, concrete_args={"x": torch.randn(2, 3, HIDDEN)})
    ops = [(n.op, n.target) for n in traced.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    assert ops == [("call_module", "proj"), ("call_function", __import__("operator").add),
                   ("call_function", OpaqueModuleCall(_GLOBAL_GATE)), ("call_method", "exp")]
    for sign in (1.0, -1.0):  # both branches, chosen when the graph runs, as in eager
        x = torch.full((2, 3, HIDDEN), sign * 4.0) + torch.randn(2, 3, HIDDEN) * 0.01
        with torch.no_grad():
            model.proj.weight.copy_(torch.eye(HIDDEN))
            model.proj.bias.zero_()
        _check_fwd_bwd(model, traced, [x], torch.float32)


class _CallsGlobalDropout(nn.Module):
    def forward(self, x):
        return _GLOBAL_DROPOUT(x * 3)


_GLOBAL_DROPOUT = nn.Dropout(0.5)


@pytest.mark.parametrize("dropout_training", [True, False])
def test_a_module_not_owned_that_reads_its_mode_is_one_call_that_follows_its_mode(dropout_training):
    model = _CallsGlobalDropout()
    _GLOBAL_DROPOUT.train(dropout_training)
    try:
        traced = trace_module(model)
        assert OpaqueModuleCall(_GLOBAL_DROPOUT) in [n.target for n in traced.graph.nodes]
        x = torch.randn(6, 9)
        for dropping in (True, False):  # the traced module's own mode does not reach it, in eager or traced
            _GLOBAL_DROPOUT.train(dropping)
            for training in (True, False):
                model.train(training)
                traced.train(training)
                torch.manual_seed(5)
                ref = model(x)
                torch.manual_seed(5)
                torch.testing.assert_close(traced(x), ref, rtol=0, atol=0)
                assert torch.equal(ref, x * 3) is not dropping
    finally:
        _GLOBAL_DROPOUT.train()


class _ReshapesTheGatesOutput(nn.Module):
    def forward(self, x):
        y = _GLOBAL_GATE(x)
        return y.view(*y.shape[:-1], 2, -1)


def test_a_shape_of_an_opaque_call_without_example_is_refused_by_name():
    with pytest.raises(TraceError, match=r"^blk: 'getitem = getitem\(getattr_1, slice\(None, -1, None\)\)' is "
                                         r"iterated over .*, so its value must be known while tracing, but no example "
                                         r"input reaches it"):
        trace_module(_ReshapesTheGatesOutput(), path="blk", concrete_args={"x": torch.randn(2, HIDDEN)})

"""shared_input_linears: linears on one input become one GEMM on weights concatenated per call, with the
same outputs and gradients, the parameters untouched; as a pass of compiled layers too."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from schedlang.graph.passes.shared_input_linears import (COUNTER, SharedInputLinearsPass,
                                                         fuse_shared_input_linears)
from tests.helpers.compiling import no_compile_caches

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


class Block(nn.Module):
    """q/k/v of unequal widths on x (no bias), gate/up on the attention output (with bias), one lone linear."""

    def __init__(self, dtype):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(13, n, bias=False, dtype=dtype) for n in (7, 5, 5))
        self.gate, self.up = nn.Linear(7, 11, dtype=dtype), nn.Linear(7, 11, dtype=dtype)
        self.lone = nn.Linear(11, 3, dtype=dtype)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        k.mul_(2)  # an output modified in place (a view of the fused output after the pass)
        a = q * (k.sum(-1, keepdim=True) + v.mean(-1, keepdim=True))
        return self.lone(F.silu(self.gate(a)) * self.up(a))


def _linears(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in (F.linear, torch._C._nn.linear))


def _traced(module: nn.Module) -> fx.GraphModule:
    """A graph whose linears are function calls on the module's parameters, as in the graphs Dynamo hands to
    Inductor."""

    class Leafless(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return False

    return fx.GraphModule(module, Leafless().trace(module))


def _forward_backward(module, x):
    x = x.detach().requires_grad_()
    out = module(x)
    out.backward(torch.ones_like(out) / out.numel())
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_two_groups_fused_and_outputs_and_gradients_unchanged(dtype):
    torch.manual_seed(0)
    block = Block(dtype)
    gm = _traced(copy.deepcopy(block))
    x = torch.randn(4, 6, 13, dtype=dtype)
    ShapeProp(gm).propagate(x)
    assert _linears(gm) == 6
    assert fuse_shared_input_linears(gm.graph) == 2
    gm.recompile()
    assert _linears(gm) == 3  # q|k|v, gate|up and the lone one
    # the parameters are the module's own: the same names, shapes and values
    assert {n: tuple(p.shape) for n, p in gm.named_parameters()} == {n: tuple(p.shape) for n, p in block.named_parameters()}
    out, dx, grads = _forward_backward(gm, x)
    ref_out, ref_dx, ref_grads = _forward_backward(block, x)
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    torch.testing.assert_close(dx, ref_dx, **TOLERANCE[dtype])
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, **TOLERANCE[dtype], msg=lambda m: f"{name}: {m}")


def test_without_shapes_or_with_a_weight_made_late_nothing_changes():
    block = Block(torch.float32)
    gm = _traced(block)
    assert fuse_shared_input_linears(gm.graph) == 0  # no recorded shapes: nothing is known to match

    class Late(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3, 4))

        def forward(self, x):
            y = F.linear(x, self.a)
            return y + F.linear(x, self.b * 2)  # the second weight exists only after the first linear

    gm = _traced(Late())
    ShapeProp(gm).propagate(torch.randn(2, 4))
    assert fuse_shared_input_linears(gm.graph) == 0


def test_the_pass_is_one_cache_key_and_instances_compare_equal():
    assert SharedInputLinearsPass() == SharedInputLinearsPass()
    assert hash(SharedInputLinearsPass()) == hash(SharedInputLinearsPass())
    assert SharedInputLinearsPass().uuid() == "schedlang.shared_input_linears.v1"


def test_compiled_with_the_pass_the_block_trains_as_eager():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    block = Block(torch.float32)
    compiled = copy.deepcopy(block)
    torch._dynamo.reset()
    counters.clear()
    compiled.forward = torch.compile(compiled.forward, options={"pre_grad_custom_pass": SharedInputLinearsPass()})
    x = torch.randn(3, 9, 13)
    with no_compile_caches():  # a cached graph would skip the pass (and its count) on a second run
        out, dx, grads = _forward_backward(compiled, x)
    assert counters["schedlang"][COUNTER] == 2
    ref_out, ref_dx, ref_grads = _forward_backward(block, x)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")

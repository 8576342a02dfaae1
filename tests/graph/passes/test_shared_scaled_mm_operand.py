"""Rule ``shared_scaled_mm_operand``: a float8 operand that several scaled matmuls read is written once."""

import copy
import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from schedlang.graph.passes.shared_scaled_mm_operand import (REALIZE_HINT, SharedScaledMMOperandPass,
                                                             mark_shared_scaled_mm_operands)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _to_float8(t):
    """Tensorwise dynamic scaling, as torchao's tensorwise recipe computes it: (float8 tensor, inverse scale)."""
    scale = (E4M3_MAX / t.abs().max().double().clamp_min(1e-12)).float()
    return (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale.reciprocal()


def _projections(x, norm, *weights):
    """One activation cast once (q, k and v's shared input), then one scaled matmul per weight."""
    h, h_inverse = _to_float8(x * norm)
    h = h.view(-1, x.shape[-1])
    outs = []
    for w in weights:
        w8, w_inverse = _to_float8(w)  # (out, in) row-major, so w8.t() is the column-major operand
        outs.append(torch._scaled_mm(h, w8.t(), h_inverse, w_inverse, out_dtype=torch.bfloat16))
    return outs


def _inputs(n_weights=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 16, 40, generator=g)
    norm = torch.rand(3, 16, 1, generator=g) + 0.5
    weights = [torch.randn(32, 40, generator=g).to(torch.bfloat16) for _ in range(n_weights)]
    return x, norm, *weights


def _scaled_mm_on_cpu():
    try:
        _projections(*_inputs(1))
    except (RuntimeError, NotImplementedError) as e:  # a torch without float8 matmuls on the CPU
        pytest.skip(f"aten._scaled_mm does not run on this CPU build: {e}")


def _flagged(gm):
    return [n for n in gm.graph.nodes if n.meta.get(REALIZE_HINT)]


def test_an_operand_read_by_several_scaled_matmuls_is_flagged_once():
    _scaled_mm_on_cpu()
    gm = make_fx(_projections)(*_inputs(3))
    assert mark_shared_scaled_mm_operands(gm.graph) == 1
    (shared,) = _flagged(gm)
    readers = [u for u in shared.users if u.target is torch.ops.aten._scaled_mm.default]
    assert len(readers) == 3 and all(u.args[0] is shared for u in readers)
    # already flagged: a second run changes nothing, and the graph itself is untouched
    assert mark_shared_scaled_mm_operands(gm.graph) == 0
    gm.graph.lint()


def test_an_operand_read_once_or_a_shared_scale_is_not_flagged():
    _scaled_mm_on_cpu()
    # one weight: the activation has one scaled-matmul reader (and its inverse scale, read by every matmul
    # as a scale argument, is realized by Inductor anyway)
    gm = make_fx(_projections)(*_inputs(1))
    assert mark_shared_scaled_mm_operands(gm.graph) == 0 and not _flagged(gm)

    def two_casts_of_one_weight(x, w):
        # two matmuls reading the same weight: the weight's cast is the shared operand, not the inputs
        w8, w_inverse = _to_float8(w)
        w8 = w8.t()  # one transposed view, as common-subexpression elimination leaves it in a compiled graph
        a8, a_inverse = _to_float8(x)
        b8, b_inverse = _to_float8(x * 2)
        return [torch._scaled_mm(a, w8, s, w_inverse, out_dtype=torch.bfloat16)
                for a, s in ((a8, a_inverse), (b8, b_inverse))]

    x, w = torch.randn(16, 40), torch.randn(32, 40).to(torch.bfloat16)
    gm = make_fx(two_casts_of_one_weight)(x, w)
    assert mark_shared_scaled_mm_operands(gm.graph) == 1
    (shared,) = _flagged(gm)
    assert shared.meta["val"].shape == (40, 32) and shared.meta["val"].dtype == E4M3  # the transposed weight


def _activation_float8_buffers(code: str) -> int:
    """Float8 buffers of the (3, 16, 40) activation, as it is or as (48, 40) tokens x hidden."""
    return len(re.findall(r"empty_strided_\w+\(\((?:3, 16, 40|48, 40)\), \((?:640, 40, 1|40, 1)\), "
                          r"torch\.float8_e4m3fn\)", code))


def test_inductor_writes_the_shared_operand_once_with_the_same_results():
    _scaled_mm_on_cpu()
    from torch._inductor.utils import run_and_get_code

    inputs = _inputs(3, seed=1)
    eager = _projections(*inputs)
    results = {}
    for name, options in (("plain", {}), ("pass", {"post_grad_custom_post_pass": SharedScaledMMOperandPass()})):
        torch._dynamo.reset()
        with torch._inductor.config.patch(force_disable_caches=True):
            out, code = run_and_get_code(torch.compile(_projections, options=options), *inputs)
        # the activation's float8 copies as (tokens, hidden) buffers, one per matmul without the rule
        results[name] = (out, _activation_float8_buffers(code[0]))
    assert results["plain"][1] == 3, "Inductor no longer copies the operand per matmul: the rule may be moot"
    assert results["pass"][1] == 1
    for got, plain, want in zip(results["pass"][0], results["plain"][0], eager):
        assert torch.equal(got, plain)
        assert torch.equal(got, want)


def test_the_pass_is_a_cacheable_inductor_pass():
    assert SharedScaledMMOperandPass() == SharedScaledMMOperandPass()
    assert SharedScaledMMOperandPass().uuid() == "schedlang.shared_scaled_mm_operand.v1"
    assert hash(SharedScaledMMOperandPass()) == hash(copy.copy(SharedScaledMMOperandPass()))


@pytest.mark.gpu
def test_a_compiled_float8_block_on_the_gpu_gives_the_same_step_with_fewer_float8_buffers():
    """q, k and v in torchao's float8 Linears (the real float8 GEMMs): forward and backward identical to the
    same compile without the rule, with fewer float8 buffers in the generated code."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with float8 tensor cores")
    float8 = pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'schedlang[fp8]')")
    from torch._inductor.utils import run_and_get_code

    class QKV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(256, 256, bias=False) for _ in range(3))

        def forward(self, x):
            return self.q(x) * self.k(x) + self.v(x)

    torch.manual_seed(0)
    block = QKV().cuda().to(torch.bfloat16)
    float8.convert_to_float8_training(block)
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    runs = {}
    for name, options in (("plain", {}), ("pass", {"post_grad_custom_post_pass": SharedScaledMMOperandPass()})):
        torch._dynamo.reset()
        model = copy.deepcopy(block)
        inp = x.clone().requires_grad_()

        def step():
            out = model(inp)
            out.float().square().sum().backward()
            return out

        with torch._inductor.config.patch(force_disable_caches=True):
            out, code = run_and_get_code(torch.compile(step, options=options))
        buffers = sum(c.count("torch.float8_e4m3fn)") for c in code)
        runs[name] = ([out, inp.grad] + [p.grad for p in model.parameters()], buffers)
    assert runs["pass"][1] < runs["plain"][1]
    for got, want in zip(runs["pass"][0], runs["plain"][0]):
        assert torch.equal(got, want)

"""Rule ``shared_amax``: whole-tensor maxima of one tensor, through any views, computed once."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

from schedlang.graph.passes.shared_amax import SharedAmaxPass, share_amax, whole_tensor_max_source

aten = torch.ops.aten
MAXIMA = (aten.max.default, aten.amax.default)


def _maxima(graph: fx.Graph) -> int:
    return sum(1 for n in graph.nodes if n.target in MAXIMA)


def _check(fn, *inputs, merged: int):
    """``fn`` traced to aten: the pass replaces ``merged`` maxima and the outputs stay bit-identical."""
    gm = make_fx(fn)(*inputs)
    expected = gm(*inputs)
    before = _maxima(gm.graph)
    assert share_amax(gm.graph) == merged
    gm.graph.lint()
    gm.recompile()
    assert _maxima(gm.graph) == before - merged
    for got, want in zip(gm(*inputs), expected):
        assert torch.equal(got, want)
    return gm


def test_views_transposes_and_copies_of_one_tensor_share_one_reduction():
    x = torch.randn(3, 7, 10)

    def fn(x):
        return (x.abs().max(), x.reshape(-1, 10).abs().max(), x.transpose(0, 1).contiguous().abs().max(),
                torch.amax(x.permute(2, 0, 1).abs(), dim=(0, 1, 2)), x.view(21, 10).t().abs().max())

    _check(fn, x, merged=4)


def test_abs_before_or_after_the_view_is_the_same_reduction():
    x = torch.randn(5, 6, dtype=torch.bfloat16)
    _check(lambda x: (x.abs().view(-1).max(), x.view(-1).abs().max(), x.abs().abs().max()), x, merged=2)


def test_different_values_stay_apart():
    x, y = torch.randn(4, 9), torch.randn(4, 9)

    def fn(x, y):
        return (x.abs().max(), y.abs().max(),          # another tensor
                x.max(),                               # without abs
                x[:, :5].abs().max(),                  # a slice: fewer elements
                x.float().mul(2).abs().max(),          # arithmetic
                x.to(torch.bfloat16).abs().max(),      # a cast to another dtype rounds
                torch.amax(x.abs(), dim=1),            # a per-row reduction depends on the layout
                torch.amax(x.abs(), dim=(0, 1), keepdim=True))  # another output shape

    _check(fn, x, y, merged=0)


def test_repeated_reductions_after_the_first_all_point_at_it():
    x = torch.randn(6, 11)
    gm = _check(lambda x: (x.abs().max() * 2, x.view(66).abs().max() + 1, x.t().abs().max() - 3), x, merged=2)
    firsts = [n for n in gm.graph.nodes if n.target in MAXIMA]
    assert len(firsts) == 1 and len(firsts[0].users) == 3


def test_source_is_found_through_views_and_dtype_preserving_copies_only():
    gm = make_fx(lambda x: (x.view(-1).abs().max(), x.abs().max(dim=0).values))(torch.randn(3, 4))
    nodes = {n.name: n for n in gm.graph.nodes}
    whole = [n for n in gm.graph.nodes if n.target is aten.max.default]
    assert len(whole) == 1
    source, through_abs = whole_tensor_max_source(whole[0])
    assert source is nodes["x_1"] and through_abs
    per_dim = [n for n in gm.graph.nodes if n.target is aten.max.dim]
    assert per_dim and whole_tensor_max_source(per_dim[0]) is None


def test_the_inductor_pass_has_a_stable_cache_identity():
    assert SharedAmaxPass().uuid() == SharedAmaxPass().uuid()


float8 = pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'schedlang[fp8]')")


class _Block(nn.Module):
    """Two Linears on one input (their scales should be shared) and one on a product."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(64, 96, bias=False)
        self.up = nn.Linear(64, 96, bias=False)
        self.down = nn.Linear(96, 64, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _float8_block(device="cpu"):
    torch.manual_seed(0)
    block = _Block().to(device=device, dtype=torch.bfloat16)
    config = float8.Float8LinearConfig.from_recipe_name("tensorwise")
    # without float8 tensor cores torchao emulates the casts and GEMMs (same scales and roundings)
    config = float8.Float8LinearConfig(**{**config.__dict__, "emulate": device == "cpu"})
    float8.convert_to_float8_training(block, config=config)
    return block


class _CountMaxima:
    """A post-grad pass that only counts the whole-tensor maxima left in each compiled graph."""

    def __init__(self):
        self.counts = []

    def __call__(self, graph):
        self.counts.append(_maxima(graph))

    def uuid(self):
        return None


def _step(block, x, compiled: bool, joint_pass=None):
    torch._dynamo.reset()
    counter = _CountMaxima()
    model = copy.deepcopy(block)
    if compiled:
        options = {"post_grad_custom_post_pass": counter}
        if joint_pass is not None:
            options["joint_custom_post_pass"] = joint_pass
        model = torch.compile(model, options=options)
    x = x.clone().requires_grad_()
    out = model(x)
    out.float().square().sum().backward()
    return [out, x.grad] + [p.grad for p in model.parameters()], counter.counts


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_compiled_float8_block_reads_each_activation_once_for_its_scale(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    block = _float8_block(device)
    # 39 tokens on the CPU; the float8 GEMMs on the GPU need multiples of 16 (the weight gradient sums over them)
    x = torch.randn(3, 13 if device == "cpu" else 16, 64, dtype=torch.bfloat16, device=device)
    eager, _ = _step(block, x, compiled=False)
    plain, plain_counts = _step(block, x, compiled=True)
    shared, shared_counts = _step(block, x, compiled=True, joint_pass=SharedAmaxPass())
    # forward: 3 weights + 2 distinct inputs; backward: the 3 output gradients only (the inputs' scales
    # come from the forward instead of a second pass over the saved activations)
    assert shared_counts == [5, 3]
    assert sum(plain_counts) > sum(shared_counts)
    # the forward is the same computation; in the backward Inductor may recompute an activation in fp32
    # where the forward rounded it to bf16, and without the pass takes that copy's scale: the shared
    # (forward's) scale is the one eager mode uses, so the result is as close to eager as before
    assert torch.equal(shared[0], plain[0])
    for got, before, want in zip(shared, plain, eager):
        assert _rel(got, want) <= _rel(before, want) + 5e-3
        assert _rel(got, want) < 0.1  # float8 (e4m3: 3 mantissa bits) against the same float8 eagerly

"""The horizontal-fusion driver: seed cases end to end, grouping, report, errors, scale."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

import schedlang
from schedlang.graph.passes import horizontal
from schedlang.graph.passes.horizontal import RULES, fused_sources, horizontal_fuse

from .models import (BranchesOnPieces, DependentLinears, EmbeddingChain, ParallelBranches, SplitAlongRows,
                     SplitLayerNormTanhCat, check_fusion, compare_with_model, count_calls, embedding_inputs, randomize)


@pytest.mark.parametrize("n,d,batch,list_sizes", [(5, 8, (7,), False), (3, 13, (2, 7), True), (50, 4, (3,), False)])
def test_seed_split_layer_norm_tanh_cat_ends_as_one_layer_norm_and_one_tanh(n, d, batch, list_sizes):
    model = randomize(SplitLayerNormTanhCat(n, d, list_sizes))
    gm, report = check_fusion(model, [torch.randn(*batch, n * d)])
    calls = count_calls(gm)
    assert calls["group_layer_norm"] == 1 and calls["tanh"] == 1
    assert not {"LayerNorm", "split", "cat", "stack", "getitem"} & set(calls)
    assert report.counts == {"layer_norm": 1, "activation": 1, "stack_unbind": 1, "cat_unbind": 1}


@pytest.mark.parametrize("concat", [False, True])
def test_seed_parallel_linear_layer_norm_relu_branches_end_as_one_of_each(concat):
    model = randomize(ParallelBranches(n=4, d_in=6, d=8, concat=concat))
    gm, report = check_fusion(model, [torch.randn(7, 13, 6)])
    calls = count_calls(gm)
    assert (calls["linear"], calls["group_layer_norm"], calls["relu"]) == (1, 1, 1)
    assert "Linear" not in calls and "LayerNorm" not in calls
    assert report.counts["linear_same_input"] == 1


def test_branches_on_the_pieces_of_a_split_use_one_batched_matmul():
    model = randomize(BranchesOnPieces(n=3, d_in=5, d=7))
    gm, _ = check_fusion(model, [torch.randn(11, 15)])
    calls = count_calls(gm)
    assert (calls["batched_linear"], calls["group_layer_norm"], calls["gelu"]) == (1, 1, 1)
    assert "stack" not in calls and "cat" not in calls  # the stacks became views


# ------------------------------------------------------------------ seed case 1 as an embedding chain
_DTYPE_TOLERANCES = [(torch.float32, 1e-5, 1.3e-6), (torch.bfloat16, 3e-2, 1.6e-2), (torch.float16, 5e-3, 1e-3)]


def _fused_every_branch(report, n):
    """The layer norms and activations of all ``n`` branches went into one op each."""
    by_rule = {r.rule: r for r in report.records}
    assert len(by_rule["layer_norm"].members) == n and len(by_rule["activation"].members) == n
    assert report.counts["layer_norm"] == 1 and report.counts["activation"] == 1


@pytest.mark.parametrize("form", ["function", "method", "sizes"])
@pytest.mark.parametrize("dtype,atol,rtol", _DTYPE_TOLERANCES)
def test_every_branch_of_an_embedding_chain_fuses_without_shapes(form, dtype, atol, rtol):
    model = randomize(EmbeddingChain(n=7, d=13, form=form)).to(dtype)
    gm, report = check_fusion(model, embedding_inputs(), atol=atol, rtol=rtol)
    _fused_every_branch(report, 7)
    calls = count_calls(gm)
    assert not {"LayerNorm", "getitem", "stack"} & set(calls)
    assert calls["tanh"] == 1
    if form == "sizes":  # every size is known: the view-based chain of the seed post
        assert calls["group_layer_norm"] == 1
    else:  # the last piece may be shorter: guarded at run time, and the cat is a span of the result
        assert (calls["piecewise_layer_norm"], calls["span_of_pieces"]) == (1, 1) and "cat" in calls  # of the bags
    assert len(list(gm.parameters())) == 7 + 2  # the bags, and one stacked weight and bias for the norms


@pytest.mark.parametrize("activation", [torch.relu, torch.nn.functional.gelu, torch.sigmoid])
def test_other_activations_fuse_on_every_branch_too(activation):
    model = randomize(EmbeddingChain(n=5, d=3, activation=activation))
    _, report = check_fusion(model, embedding_inputs(batch=4))
    _fused_every_branch(report, 5)


@pytest.mark.parametrize("dtype,atol,rtol", _DTYPE_TOLERANCES)
def test_a_last_piece_that_really_is_shorter_gives_the_unfused_result(dtype, atol, rtol):
    model = randomize(SplitAlongRows(n=7, d=13, e=6)).to(dtype)
    gm, report = check_fusion(model, [torch.randn(4, 7 * 13, 6, dtype=dtype)], atol=atol, rtol=rtol)
    _fused_every_branch(report, 7)
    # the same fused graph on inputs whose last piece is shorter, or with a part after the pieces
    for width in (7 * 13 - 5, 6 * 13 + 1, 7 * 13 + 5):
        compare_with_model(model, gm, [torch.randn(3, width, 6, dtype=dtype)], atol=atol, rtol=rtol)
    with pytest.raises(IndexError):  # piece 6 does not exist: as in the unfused model
        gm(torch.randn(3, 6 * 13, 6, dtype=dtype))


def test_example_inputs_give_the_rules_every_shape():
    model = randomize(EmbeddingChain(n=7, d=13))
    inputs = embedding_inputs()
    gm, report = check_fusion(model, inputs, example_inputs=inputs)
    _fused_every_branch(report, 7)
    calls = count_calls(gm)
    assert calls["group_layer_norm"] == 1 and not {"piecewise_layer_norm", "span_of_pieces"} & set(calls)
    assert all(not k.startswith("schedlang") for n in gm.graph.nodes for k in n.meta)  # no notes left behind
    # a genuinely shorter last piece, with shapes known: it stays apart, exactly as computed before
    model = randomize(SplitAlongRows(n=7, d=13, e=6))
    x = torch.randn(4, 7 * 13 - 5, 6)
    gm, report = check_fusion(model, [x], example_inputs=[x])
    assert len(report.records[0].members) == 6 and count_calls(gm)["LayerNorm"] == 1


def test_bad_example_inputs_name_the_path_and_the_inputs():
    gm = fx.symbolic_trace(SplitAlongRows(n=2, d=3, e=4))
    before, meta = gm.code, [set(n.meta) for n in gm.graph.nodes]
    with pytest.raises(schedlang.ScheduleTypeError, match=r"^feats: horizontal_fuse example_inputs must be a list "
                                                          r"of tensors, one per input of the traced forward \(x\), "
                                                          r"got \[\(2, 6, 4\) float32, int\]$"):
        horizontal_fuse(gm, path="feats", example_inputs=[torch.randn(2, 6, 4), 3])
    with pytest.raises(schedlang.ScheduleValueError, match=r"^feats: horizontal_fuse example_inputs has 2 tensor\(s\), "
                                                           r"but the traced forward takes 1 \(x\); pass one tensor per "
                                                           r"input$"):
        horizontal_fuse(gm, path="feats", example_inputs=[torch.randn(2, 6, 4)] * 2)
    with pytest.raises(schedlang.ScheduleValueError, match=r"^<root>: horizontal_fuse cannot run the traced graph on "
                                                           r"example_inputs \[\(2, 6, 5\) float32\] at node 'norms_0': "
                                                           r"RuntimeError: Given normalized_shape=\[4\], .+; pass tensors "
                                                           r"shaped as in a real call of forward \(x\)$"):
        horizontal_fuse(gm, example_inputs=[torch.randn(2, 6, 5)])  # the layer norms need a last dim of 4
    assert gm.code == before and [set(n.meta) for n in gm.graph.nodes] == meta


def _traced_with_shapes(model, *inputs):
    gm = fx.symbolic_trace(model)
    ShapeProp(gm).propagate(*inputs)
    return gm


def test_dependent_linears_stay_apart():
    model = randomize(DependentLinears(d=6, depth=3))
    x = torch.randn(5, 6)
    gm = _traced_with_shapes(model, x)
    fused, report = check_fusion(model, [x], gm=gm)
    assert len(report) == 0
    assert count_calls(fused) == {"Linear": 3}


class ChainAndParallel(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x, y):
        a = self.l0(x)
        b = self.l1(a)  # depends on l0
        c = self.l2(y)  # independent of both
        return b, c


def test_independent_linears_fuse_while_the_dependent_one_stays():
    model = randomize(ChainAndParallel())
    x, y = torch.randn(5, 6), torch.randn(5, 6)
    fused, report = check_fusion(model, [x, y], gm=_traced_with_shapes(model, x, y))
    fused_record = [r for r in report.records if r.rule == "linear_batched"]
    assert len(fused_record) == 1 and set(fused_record[0].members) == {"l0", "l2"}
    assert count_calls(fused)["Linear"] == 1


class Functional(nn.Module):
    """The functional and method spellings of every fused op."""

    def __init__(self, n=3, d=6):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(d, d)) for _ in range(n))
        self.b = nn.ParameterList(nn.Parameter(torch.randn(d)) for _ in range(n))
        self.g = nn.ParameterList(nn.Parameter(torch.randn(d)) for _ in range(n))
        self.silu = nn.ModuleList(nn.SiLU() for _ in range(n))

    def forward(self, x):
        hs = [F.linear(x, self.w[i], self.b[i]) for i in range(len(self.w))]
        hs = [F.layer_norm(h, (6,), self.g[i], None, 1e-6) for i, h in enumerate(hs)]
        hs = [h.tanh() for h in hs]
        hs = [F.gelu(h, approximate="tanh") for h in hs]
        hs = [self.silu[i](h) for i, h in enumerate(hs)]
        return torch.cat(hs, -1)


def test_functional_method_and_module_forms_fuse():
    model = Functional()
    gm, report = check_fusion(model, [torch.randn(4, 9, 6)])
    calls = count_calls(gm)
    assert calls == {"linear": 1, "unflatten": 1, "group_layer_norm": 1, "tanh": 1, "gelu": 1, "silu": 1,
                     "flatten": 1}


class TiedBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 4), nn.Linear(5, 4)
        self.b.weight = self.a.weight  # tied: must stay one parameter

    def forward(self, x):
        return self.a(x) * self.b(x)


def test_tied_weights_stay_tied():
    model = randomize(TiedBranches())
    gm, report = check_fusion(model, [torch.randn(3, 5)])
    assert report.counts == {"linear_same_input": 1}
    assert {n for n, _ in gm.named_parameters()} == {"a.weight", "a.bias", "b.bias"}


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.n = nn.ModuleList(nn.LayerNorm(4) for _ in range(3))
        self.n[1].register_forward_hook(lambda m, i, o: o * 2)

    def forward(self, x):
        p = x.split(4, -1)
        return [self.n[i](p[i]) for i in range(3)]


def test_modules_with_hooks_are_left_alone():
    model = randomize(Hooked())
    gm, report = check_fusion(model, [torch.randn(3, 12)])  # the hook still doubles piece 1
    assert [r.members for r in report.records if r.rule == "layer_norm"] == [("n_0", "n_2")]
    assert count_calls(gm)["LayerNorm"] == 1


def test_min_group_size_and_rule_subsets():
    model = randomize(ParallelBranches(n=3))
    x = torch.randn(4, 6)
    _, report = check_fusion(model, [x], min_group_size=4)
    assert len(report) == 0
    gm, report = check_fusion(model, [x], rules=["layer_norm", "linear_same_input"])
    assert set(report.counts) == {"layer_norm", "linear_same_input"}
    assert count_calls(gm)["relu"] == 3


def test_second_run_finds_nothing_and_the_graph_survives_deepcopy():
    model = randomize(SplitLayerNormTanhCat(4, 6))
    gm, _ = check_fusion(model, [torch.randn(3, 24)])
    again = horizontal_fuse(gm)
    assert len(again) == 0 and "nothing to fuse" in str(again)
    x = torch.randn(5, 24)
    torch.testing.assert_close(copy.deepcopy(gm)(x), model(x))


def test_report_says_which_rule_fused_what():
    model = randomize(ParallelBranches(n=3, d_in=5, d=4))
    gm = fx.symbolic_trace(model)
    report = horizontal_fuse(gm, path="towers")
    text = str(report)
    assert text.startswith("horizontal_fuse at 'towers': 5 rewrite(s) in 2 sweep(s)")
    assert "[linear_same_input] linears_0, linears_1, linears_2 -> linear: 3 x linear(5->[4]) on 'x'" in text
    assert "hfused_linear_weight_0 (12, 5) <- linears.0.weight, linears.1.weight, linears.2.weight" in text
    assert report.counts == {"linear_same_input": 1, "layer_norm": 1, "activation": 1, "stack_unbind": 1,
                             "split_cat": 1}  # the forward returns the unbind's own tuple
    assert gm.graph.output_node().args[0].target == "unbind"
    weight = gm.hfused_linear_weight_0
    assert [src.name for _, src in fused_sources(weight)] == ["linears.0.weight", "linears.1.weight",
                                                              "linears.2.weight"]


@pytest.mark.parametrize("rules,error,message", [
    (["layer_norm", "fuse_everything"], schedlang.ScheduleValueError,
     r"<root>: unknown horizontal fusion rule 'fuse_everything': valid rules are linear_same_input, "
     r"linear_batched, layer_norm, activation, split_cat, stack_unbind, cat_unbind"),
    ("layer_norm", schedlang.ScheduleTypeError,
     r"<root>: horizontal_fuse rules must be None or a list of rule names, got 'layer_norm'; valid rules are "),
])
def test_bad_rules(rules, error, message):
    with pytest.raises(error, match=message):
        horizontal_fuse(fx.symbolic_trace(ParallelBranches()), rules=rules)


def test_bad_min_group_size():
    with pytest.raises(schedlang.ScheduleValueError, match=r"<root>: min_group_size must be an int >= 2, got 1"):
        horizontal_fuse(fx.symbolic_trace(ParallelBranches()), min_group_size=1)


def test_a_failing_rule_leaves_the_module_unchanged(monkeypatch):
    model = randomize(ParallelBranches(n=3))
    gm = fx.symbolic_trace(model)
    code, params = gm.code, dict(gm.named_parameters())

    def broken(self, ctx, key, members):
        original(self, ctx, key, members)  # half-done work on the private graph copy ...
        raise RuntimeError("boom")  # ... then a failure

    original = type(RULES["layer_norm"]).rewrite
    monkeypatch.setattr(type(RULES["layer_norm"]), "rewrite", broken)
    with pytest.raises(RuntimeError, match="boom"):
        horizontal_fuse(gm)
    assert gm.code == code and dict(gm.named_parameters()) == params
    x = torch.randn(2, 6)
    torch.testing.assert_close(gm(x), model(x))


class TwoTowers(nn.Module):
    """Parallel linears on x and on y: each tower fuses into one GEMM, then the towers batch."""

    def __init__(self):
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(5, 3) for _ in range(2))
        self.b = nn.ModuleList(nn.Linear(5, 3) for _ in range(2))

    def forward(self, x, y):
        return [m(x) for m in self.a] + [m(y) for m in self.b]


def test_fused_parameters_fused_again_map_back_to_the_originals():
    model = randomize(TwoTowers())
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    gm, report = check_fusion(model, [x, y], gm=_traced_with_shapes(model, x, y))
    assert report.counts["linear_same_input"] == 2 and report.counts["linear_batched"] == 1
    (name,) = [n for n in dict(gm.named_parameters()) if "blinear_weight" in n]
    info = horizontal.fused_parameter_sources(gm)[name]
    assert info.sources[0].steps == (("select", 0, 0, 1), ("narrow", 0, 0, 3))


def test_bfloat16_parallel_linears():
    model = randomize(ParallelBranches(n=5, d_in=16, d=8, concat=True)).to(torch.bfloat16)
    check_fusion(model, [torch.randn(6, 16, dtype=torch.bfloat16)], atol=2e-2, rtol=2e-2)


class ManyBlocks(nn.Module):
    """Blocks of 4 parallel Linear -> LayerNorm -> ReLU branches, concatenated, with a residual."""

    def __init__(self, blocks, n=4, d=4):
        super().__init__()
        self.blocks = nn.ModuleList(ParallelBranches(n, n * d, d, concat=True) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x) + x
        return x


@pytest.fixture
def one_thread():
    # ten thousand tiny ops: intra-op threads only add contention on a busy 2-core machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_ten_thousand_node_graph_is_fused_completely(one_thread):
    # (the time this takes is measured by bench/bench_horizontal.py, not here)
    model = ManyBlocks(715)
    gm = fx.symbolic_trace(model)
    assert len(gm.graph.nodes) >= 10_000
    x = torch.randn(3, 16)
    expected = model(x)
    report = horizontal_fuse(gm)
    assert report.counts == {"linear_same_input": 715, "layer_norm": 715, "activation": 715,
                             "stack_unbind": 715, "cat_unbind": 715}
    torch.testing.assert_close(gm(x), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_seed_cases_on_the_gpu(dtype, tol):
    for model, x in ((SplitLayerNormTanhCat(50, 64), torch.randn(64, 3200)),
                     (ParallelBranches(n=32, d_in=256, d=64, concat=True), torch.randn(64, 256))):
        model = randomize(model).to("cuda", dtype)
        gm, _ = check_fusion(model, [x.to("cuda", dtype)], atol=tol, rtol=tol)
        assert next(gm.parameters()).is_cuda


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("with_examples", [False, True])
def test_embedding_chain_on_the_gpu(dtype, tol, with_examples):
    model = randomize(EmbeddingChain(n=50, d=64, rows=1000)).to("cuda", dtype)
    inputs = [t.cuda() for t in embedding_inputs(batch=64, rows=1000)]
    gm, report = check_fusion(model, inputs, atol=tol, rtol=tol, example_inputs=inputs if with_examples else None)
    _fused_every_branch(report, 50)
    assert count_calls(gm)["group_layer_norm" if with_examples else "piecewise_layer_norm"] == 1

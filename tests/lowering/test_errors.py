"""Every error the fusion compilers raise, with its message pinned."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from schedlang.errors import LoweringError, ScheduleTypeError, ScheduleValueError
from schedlang.lowering import lower_subgraph, normalize_compiler
from schedlang.lowering.inductor import InductorFusedSubgraph

from .utils import DEVICE


class CustomNorm(nn.Module):
    """A norm the triton compiler does not know (as LlamaRMSNorm is when kept as a leaf)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.weight


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = CustomNorm()

    def forward(self, x, w):
        return F.gelu(self.norm(self.proj(torch.matmul(x, w).cumsum(0))))


class _LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, CustomNorm) or super().is_leaf_module(m, qualname)


def _mixed_graph():
    model = Mixed()
    return torch.fx.GraphModule(model, _LeafTracer().trace(model))


def test_unsupported_ops_are_all_listed_with_alternatives():
    with pytest.raises(LoweringError) as info:
        lower_subgraph(_mixed_graph(), "triton", "Mixed")
    message = str(info.value)
    assert message.startswith("cannot fuse subgraph 'Mixed' with compiler='triton': 4 unsupported operations:")
    assert "node 'matmul' (matmul = torch.matmul(x, w)): torch.matmul has no triton lowering" in message
    assert "node 'cumsum' (cumsum = matmul.cumsum(0)): Tensor.cumsum has no triton lowering" in message
    assert "node 'proj' (proj = self.proj(cumsum)  # nn.Linear): nn.Linear is not a module the triton " \
           "compiler knows" in message
    assert "node 'norm' (norm = self.norm(proj)" in message and "CustomNorm is not a module" in message
    assert "gelu" not in message  # supported ops are not reported
    assert message.endswith("use compiler='inductor' (torch.compile) or compiler='eager' for this subgraph, "
                            "or leave these operations out of it")


def test_the_other_compilers_take_what_triton_does_not():
    gm = _mixed_graph()
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    torch.testing.assert_close(lower_subgraph(gm, "eager", "Mixed")(x, w), gm(x, w))


def test_shape_dependent_problems_are_listed_at_lowering_with_example_inputs():
    gm = torch.fx.symbolic_trace(lambda x: F.softmax(x, dim=0) + x.sum(0, keepdim=True) + x.mean())
    with pytest.raises(LoweringError, match=r"'Reduce'.*3 unsupported operations:\n"
                                            r"  - node 'softmax' .*: softmax over dim=0: only the last dimension "
                                            r"\(dim=-1\) is fused\n"
                                            r"  - node 'sum_1' .*: sum over dim=0: only the last dimension.*\n"
                                            r"  - node 'mean' .*: mean over all dimensions"):
        lower_subgraph(gm, "triton", "Reduce", example_inputs=[torch.randn(4, 8)])


def test_shape_dependent_problems_surface_at_first_call_without_example_inputs():
    gm = torch.fx.symbolic_trace(lambda x: torch.softmax(x, 0))
    fused = lower_subgraph(gm, "triton", "Reduce")  # no shapes yet: nothing to object to
    with pytest.raises(LoweringError, match=r"node 'softmax' .*: softmax over dim=0"):
        fused(torch.randn(4, 8, device=DEVICE))


def test_reduction_without_keepdim_broadcast_against_rows():
    gm = torch.fx.symbolic_trace(lambda x: x.sum(-1) + x)
    with pytest.raises(LoweringError, match=r"node 'add' .*: mixes a reduction taken without keepdim=True with "
                                            r"tensors that keep the last dimension .* reduce with keepdim=True"):
        lower_subgraph(gm, "triton", "Squeezed", example_inputs=[torch.randn(4, 4)])


def test_integer_inputs_and_casts():
    gm = torch.fx.symbolic_trace(lambda x, idx: x * idx)
    with pytest.raises(LoweringError, match=r"node 'idx' .*: input of dtype torch.int64 \(floating-point and "
                                            r"bool tensors are fused\)"):
        lower_subgraph(gm, "triton", "IntIn", example_inputs=[torch.randn(4, 4), torch.ones(4, 4, dtype=torch.long)])
    gm = torch.fx.symbolic_trace(lambda x: x.to(torch.int32) * 2)
    with pytest.raises(LoweringError, match=r"node 'to' .*: cast to torch.int32 \(only floating-point"):
        lower_subgraph(gm, "triton", "IntCast", example_inputs=[torch.randn(4, 4)])


def test_bad_arguments_of_supported_ops():
    gm = torch.fx.symbolic_trace(lambda x, y: (torch.div(x, y, rounding_mode="floor"),
                                               F.layer_norm(x, (4, 4)), x[0]))
    with pytest.raises(LoweringError, match=r"3 unsupported operations:\n"
                                            r".*division with rounding_mode='floor'\n"
                                            r".*layer_norm over normalized_shape=\(4, 4\): only the last dimension"
                                            r" is fused\n"
                                            r".*indexing a tensor \(only whole tensors are fused\)"):
        lower_subgraph(gm, "triton", "BadArgs", example_inputs=[torch.randn(4, 4), torch.randn(4, 4)])


def test_subgraph_that_fails_on_the_given_shapes():
    gm = torch.fx.symbolic_trace(lambda x, y: x + y)
    with pytest.raises(LoweringError, match=r"node 'add' \(add = operator.add\(x, y\)\): PyTorch rejects it for "
                                            r"inputs of shapes \(4, 5\) float32, \(3,\) float32: .*broadcast"):
        lower_subgraph(gm, "triton", "Bad", example_inputs=[torch.randn(4, 5), torch.randn(3)])


def test_partially_broadcast_output_is_rejected():
    gm = torch.fx.symbolic_trace(lambda x, pos: (x + pos, pos * 2))
    with pytest.raises(LoweringError, match=r"node 'mul' .*: output of shape \(1, 3, 8\) is broadcast over some "
                                            r"leading dimensions of \(2, 3, 8\)"):
        lower_subgraph(gm, "triton", "PartOut", example_inputs=[torch.randn(2, 3, 8), torch.randn(1, 3, 8)])


def test_unknown_compiler():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(ScheduleValueError, match=r"unknown compiler 'nvfuser': valid compilers are 'triton', "
                                                 r"'inductor', 'eager', 'torchscript', or None \(no compiler: the "
                                                 r"subgraph's modules in one container\)"):
        lower_subgraph(gm, "nvfuser", "AddOne")
    with pytest.raises(ScheduleTypeError, match=r"compiler must be a string, got None \(NoneType\): valid "
                                                r"compilers are 'triton', 'inductor', 'eager'"):
        lower_subgraph(gm, None, "AddOne")


class _AddOne(torch.nn.Module):
    def forward(self, x):
        return x + 1


def _first_of(*values):  # variadic: TorchScript cannot compile a call to it
    return values[0]


@pytest.mark.parametrize("spelling", ["TorchScript", "torchscript", "TORCHSCRIPT"])
def test_torchscript_scripts_the_subgraph(spelling):
    gm = torch.fx.symbolic_trace(_AddOne())  # TorchScript reads the generated source of a named class
    fused = lower_subgraph(gm, spelling, "AddOne")
    assert isinstance(fused, torch.jit.ScriptModule)
    x = torch.randn(3, 5)
    torch.testing.assert_close(fused(x), x + 1)


def test_torchscript_falls_back_to_inductor_where_it_cannot_compile():
    gm = torch.fx.symbolic_trace(_AddOne())
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        first = gm.graph.call_function(_first_of, (out.args[0], out.args[0]))
    out.args = (first,)
    gm.recompile()
    with pytest.warns(UserWarning, match=r"fuse TanhTwice: TorchScript cannot compile the subgraph .*; lowered with "
                                         r"compiler='inductor' instead"):
        fused = lower_subgraph(gm, "torchscript", "TanhTwice")
    assert isinstance(fused, InductorFusedSubgraph)


def test_compiler_names_are_case_insensitive():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [normalize_compiler(c) for c in ("Triton", "INDUCTOR", " eager ")] == ["triton", "inductor", "eager"]


def test_bad_module_name_and_bad_graph():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(ScheduleValueError, match=r"fused module name must be a Python identifier, got 'bias gelu'"):
        lower_subgraph(gm, "triton", "bias gelu")
    with pytest.raises(ScheduleTypeError, match=r"lower_subgraph: expects a torch.fx.GraphModule, got Linear"):
        lower_subgraph(nn.Linear(2, 2), "triton", "Lin")


def test_wrong_number_or_kind_of_inputs():
    fused = lower_subgraph(torch.fx.symbolic_trace(lambda x, b: x + b), "triton", "Add")
    with pytest.raises(ScheduleTypeError, match=r"Add: expected 2 inputs \(x, b\), got 1"):
        fused(torch.randn(2, 2, device=DEVICE))
    with pytest.raises(ScheduleTypeError, match=r"Add: input 'b' is a float; the triton compiler takes tensors only"):
        fused(torch.randn(2, 2, device=DEVICE), 1.0)


def test_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fused = lower_subgraph(torch.fx.symbolic_trace(lambda x: x + 1), "triton", "AddOne")
    with pytest.raises(LoweringError, match=r"AddOne: compiler='triton' runs on CUDA tensors \(or on CPU with "
                                            r"TRITON_INTERPRET=1\), got tensors on cpu; use compiler='inductor' or "
                                            r"compiler='eager' on this device"):
        fused(torch.randn(2, 2))

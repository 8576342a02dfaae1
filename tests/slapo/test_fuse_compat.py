"""fuse the way Slapo scripts call it: compiler=None (no compiler), compiler="TorchScript", a subgraph that
holds a convolution."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import schedlang as slapo
from schedlang.pattern import call_module


class ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1, stride=2)
        self.act = nn.ReLU()
        self.head = nn.Linear(5, 4)

    def forward(self, x):
        y = self.act(self.conv(x)) * 0.5
        return self.head(y.mean((2, 3)))


def _pattern(x):
    return F.relu(call_module("conv", x)) * 0.5


def _check_same(model, scheduled, *inputs):
    ins = [t.clone().requires_grad_(True) for t in inputs]
    ref_ins = [t.clone().requires_grad_(True) for t in inputs]
    out, ref = scheduled(*ins), model(*ref_ins)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for a, b in zip(ins, ref_ins):
        torch.testing.assert_close(a.grad, b.grad)


def test_no_compiler_gathers_the_modules_in_a_container_named_after_the_fusion():
    model = ConvBlock()
    sch = slapo.create_schedule(model)
    subgraphs = sch.find(_pattern)
    assert len(subgraphs) == 1 and len(subgraphs[0]) == 3
    sch.fuse(subgraphs, compiler=None, name="ConvAct")
    fused = sch["ConvAct_0"].mod
    assert type(fused).__name__ == "ConvAct"
    assert isinstance(getattr(fused, "0"), nn.Conv2d) and isinstance(getattr(fused, "1"), nn.ReLU)
    assert sch.plan[-1].args["compiler"] is None
    _check_same(model, sch.mod, torch.randn(2, 3, 9, 7))
    built, _ = slapo.build(sch)
    _check_same(model, built, torch.randn(1, 3, 6, 6))


@pytest.mark.parametrize("compiler", ["TorchScript", "inductor", "eager"])
def test_a_subgraph_holding_a_convolution_is_fused_with_its_weights_as_inputs(compiler):
    model = ConvBlock()
    sch = slapo.create_schedule(model)
    sch.fuse(sch.find(_pattern), compiler=compiler, name="ConvAct")
    if compiler == "TorchScript":
        assert isinstance(sch["ConvAct_0"].mod, torch.jit.ScriptModule)
    # the convolution's weights stay where they were: same names, same tensors
    assert sch.mod.conv.weight is dict(sch.mod.named_parameters())["conv.weight"]
    _check_same(model, sch.mod, torch.randn(2, 3, 9, 7))


def test_verify_checks_a_torchscript_fusion():
    model = ConvBlock()
    sch = slapo.create_schedule(model)
    subgraphs = sch.find(_pattern)
    with slapo.Verify(sch, torch.randn(2, 3, 8, 8)) as check:
        sch.fuse(subgraphs, compiler="TorchScript", name="ConvAct")
    assert check.report.passed


def test_an_unknown_compiler_names_the_valid_ones():
    sch = slapo.create_schedule(ConvBlock())
    with pytest.raises(slapo.ScheduleValueError, match=r"unknown compiler 'nvfuser': valid compilers are 'triton', "
                                                       r"'inductor', 'eager', 'torchscript', or None"):
        sch.fuse(sch.find(_pattern), compiler="nvfuser", name="ConvAct")
    assert len(sch.plan) <= 1  # only find's trace step, nothing of the fuse

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import schedlang
from schedlang.module_record import module_record
from tests.helpers.models import MLP, Stack


class BackwardBrokenGELU(torch.autograd.Function):
    """GELU in forward, a wrong gradient in backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(x)  # not GELU's derivative


class BrokenGELU(nn.Module):
    def forward(self, x):
        return BackwardBrokenGELU.apply(x)


def test_verify_passes_on_a_correct_schedule_and_reports():
    sch = schedlang.create_schedule(Stack())
    x = torch.randn(4, 12)
    with schedlang.Verify(sch, example_inputs=[x]) as v:
        sch["layers.0.mlp.fc1"].decompose()
        sch["layers.1"].checkpoint()
        sch["layers.0.mlp.fc1"].shard("weight", axis=0)
        sch["layers.0.mlp.fc1"].shard("bias", axis=0)
    assert v.report.passed
    assert "output" in v.report.compared and "input[0] gradient" in v.report.compared
    assert any("shard 0/1 along axis 0 of 'layers.0.mlp.fc1.weight'" in c for c in v.report.compared)
    assert "training mode: gradient of parameter 'layers.1.mlp.fc2.weight'" in v.report.compared  # dropout on
    assert "Verify passed" in str(v.report)
    # the same schedule with one wrong step is caught, in forward and in both modes
    sch = schedlang.create_schedule(Stack())
    with pytest.raises(schedlang.VerificationError) as info:
        with schedlang.Verify(sch, example_inputs=[x]):
            sch["layers.0.mlp.fc1"].decompose()
            sch["layers.1"].checkpoint()
            sch["layers.1.mlp.act"].replace(nn.SiLU())
    assert "first diverging module (in execution order): 'layers.1.mlp.act' (SiLU)" in str(info.value)
    assert len(sch.plan) == 0


def test_verify_catches_a_replacement_that_only_breaks_backward():
    sch = schedlang.create_schedule(MLP(7, 13))
    x = torch.randn(5, 7)
    with pytest.raises(schedlang.VerificationError) as info:
        with schedlang.Verify(sch, example_inputs=[x]):
            sch["act"].replace(BrokenGELU())
    text = str(info.value)
    assert not any(line.strip().startswith("output") for line in text.splitlines())  # forward is fine
    assert "input[0] gradient: max abs diff" in text
    assert "gradient of parameter 'fc1.weight'" in text
    assert "steps applied inside this Verify block:\n  #0 replace at 'act' (new_mod_or_fn=<BrokenGELU>)" in text
    assert isinstance(info.value, AssertionError)


def test_verify_catches_a_forward_change_and_names_the_output():
    sch = schedlang.create_schedule(MLP())
    with pytest.raises(schedlang.VerificationError, match=r"output: max abs diff .* elements outside rtol"):
        with schedlang.Verify(sch, example_inputs=[torch.randn(3, 12)], check_backward=False):
            sch["act"].replace(nn.ReLU())


def test_verify_blames_earlier_steps_when_block_is_empty():
    sch = schedlang.create_schedule(MLP())
    sch["act"].replace(nn.Tanh())
    with pytest.raises(schedlang.VerificationError, match="no steps were applied inside this Verify block"):
        with schedlang.Verify(sch, example_inputs=[torch.randn(3, 12)]):
            pass


def test_verify_is_skipped_when_the_block_raises_or_disabled():
    sch = schedlang.create_schedule(MLP())
    with pytest.raises(schedlang.ShardError):
        with schedlang.Verify(sch, example_inputs=[torch.randn(3, 12)]):
            sch["fc1"].shard("weight", axis=7)
    with schedlang.Verify(sch, example_inputs=[torch.randn(3, 12)], enable=False):
        sch["act"].replace(nn.ReLU())


def test_verify_bf16_tolerances_and_kwargs():
    class KW(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x, scale=None):
            return self.lin(x) * scale

    model = KW().to(torch.bfloat16)
    sch = schedlang.create_schedule(model)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    s = torch.rand(16, dtype=torch.bfloat16)
    with schedlang.Verify(sch, example_inputs=[x], example_kwargs={"scale": s}) as v:
        sch["lin"].decompose()
    assert "input 'scale' gradient" in v.report.compared
    assert "gradient of parameter 'lin.weight'" in v.report.compared
    # a bias off by one bf16 step on every element is outside the bf16 tolerance
    wrong = nn.Linear(16, 16).to(torch.bfloat16)
    wrong.load_state_dict(model.lin.state_dict())
    with torch.no_grad():
        wrong.bias.add_(0.25)
    whole_tensor = r"output: max abs diff .* relative error of the whole tensor"
    with pytest.raises(schedlang.VerificationError, match=whole_tensor):
        with pytest.warns(schedlang.verify.VerifyWarning, match="parameter 'lin.bias'"):
            with schedlang.Verify(sch, example_inputs=[x], example_kwargs={"scale": s}):
                sch["lin"].replace(wrong)


def test_verify_argument_errors():
    sch = schedlang.create_schedule(MLP())
    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"^Verify: example_inputs must be a tensor, or a list or tuple of inputs, got int$"):
        schedlang.Verify(sch, example_inputs=5)
    # Slapo's forms (one tensor, device=, eval_mode=, a meta-device model) are tested in tests/slapo/test_verify_args.py


@pytest.mark.parametrize("kwargs, message", [
    (dict(rtol=-1), r"^Verify: rtol must be a finite number >= 0, got -1$"),
    (dict(atol=-1), r"^Verify: atol must be a finite number >= 0, got -1$"),
    (dict(rtol="x"), r"^Verify: rtol must be a finite number >= 0, got 'x'$"),
    (dict(seed="x"), r"^Verify: seed must be an int, got 'x'$"),
    (dict(reduction_size=-5), r"^Verify: reduction_size must be an int >= 1, got -5$"),
    (dict(example_kwargs=5), r"^Verify: example_kwargs must be a dict of keyword inputs \{name: value\} or None, "
                             r"got int$"),
], ids=["rtol", "atol", "rtol str", "seed str", "reduction_size", "example_kwargs"])
def test_verify_refuses_bad_arguments_before_the_block_runs(kwargs, message):
    sch = schedlang.create_schedule(MLP())
    ran = []
    with pytest.raises(schedlang.ScheduleValueError, match=message):
        with schedlang.Verify(sch, example_inputs=[torch.randn(2, 12)], **kwargs):
            ran.append(True)
    assert not ran and len(sch.plan) == 0


def test_verify_takes_a_schedule_not_a_model():
    with pytest.raises(schedlang.ScheduleValueError, match=r"^Verify: sch must be a schedlang.Schedule \(from "
                                                          r"schedlang.create_schedule\(model\)\), got MLP$"):
        schedlang.Verify(MLP(), example_inputs=[torch.randn(2, 12)])


def test_verify_reports_running_errors_as_mismatch():
    sch = schedlang.create_schedule(MLP())
    with pytest.raises(schedlang.VerificationError,
                       match=r"running the scheduled model \(eval mode\) raised RuntimeError"):
        with schedlang.Verify(sch, example_inputs=[torch.randn(2, 12)]):
            sch["fc1"].replace(nn.Linear(3, 20))


@pytest.mark.gpu
def test_verify_on_cuda_catches_backward_only_bug():
    sch = schedlang.create_schedule(MLP(7, 13))
    x = torch.randn(5, 7, device="cuda")
    with schedlang.Verify(sch, example_inputs=[x]) as v:
        sch["fc1"].decompose()
        sch["fc1"].shard("weight", axis=0)
        sch["fc1"].shard("bias", axis=0)
    assert v.report.passed
    with pytest.raises(schedlang.VerificationError, match="input\\[0\\] gradient"):
        with schedlang.Verify(sch, example_inputs=[x]):
            sch["act"].replace(BrokenGELU())


class ParallelBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(6, 5)

    def forward(self, x):
        return torch.tanh(self.a(x)) + torch.tanh(self.b(x))


def test_verify_compares_horizontally_fused_parameters_part_by_part():
    sch = schedlang.create_schedule(ParallelBranches())
    with schedlang.Verify(sch, example_inputs=[torch.randn(4, 6)]) as v:
        sch.trace(flatten=True)
        sch.horizontal_fuse()
    assert v.report.passed and not v.report.not_compared
    assert any("(the part that is 'a.weight')" in c for c in v.report.compared)
    assert any("(the part that is 'b.bias')" in c for c in v.report.compared)



def test_a_failed_block_is_undone_and_the_schedule_still_builds():
    model = Stack()
    sch = schedlang.create_schedule(model)
    sch["layers.0.mlp.fc1"].decompose()  # before the block: stays
    x = torch.randn(4, 12)
    with pytest.raises(schedlang.VerificationError):
        with schedlang.Verify(sch, example_inputs=[x]):
            sch["layers.1"].checkpoint()
            sch["layers.1.mlp.act"].replace(nn.ReLU())  # wrong
    assert [s.primitive for s in sch.plan] == ["decompose"]
    assert type(sch["layers.1.mlp.act"].mod) is nn.GELU
    assert not module_record(sch["layers.1"].mod).checkpointed
    with schedlang.Verify(sch, example_inputs=[x]) as v:  # and the schedule goes on
        sch["layers.1"].checkpoint()
    assert v.report.passed and [s.primitive for s in sch.plan] == ["decompose", "checkpoint"]
    built, _ = schedlang.build(sch)
    model.eval()
    built.eval()
    torch.testing.assert_close(built(x), model(x), rtol=1e-5, atol=1e-5)

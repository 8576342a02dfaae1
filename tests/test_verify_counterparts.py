"""No silent gaps: every parameter and buffer of the scheduled model is compared with its counterpart in
the original, or named in a warning and in the report."""

import warnings

import pytest
import torch
from torch import nn

import schedlang
from schedlang.verify import VerifyWarning
from tests.helpers.models import MLP


class RenamedLinear(nn.Module):
    """A Linear with other parameter names ('w', 'b'), built from an existing Linear's weights."""

    def __init__(self, linear: nn.Linear, grad_scale: float = 1.0):
        super().__init__()
        self.w = nn.Parameter(linear.weight.detach().clone())
        self.b = nn.Parameter(linear.bias.detach().clone())
        self.grad_scale = grad_scale

    def forward(self, x):
        w = self.w * self.grad_scale + (self.w * (1 - self.grad_scale)).detach()  # forward unchanged
        return nn.functional.linear(x, w, self.b)


def test_a_replaced_module_with_other_names_is_matched_by_value_and_compared():
    model = MLP(7, 13)
    sch = schedlang.create_schedule(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", VerifyWarning)
        with schedlang.Verify(sch, example_inputs=[torch.randn(5, 7)]) as v:
            sch["fc1"].replace(RenamedLinear(model.fc1))
    assert "gradient of parameter 'fc1.w' (matched by value to 'fc1.weight')" in v.report.compared
    assert "gradient of parameter 'fc1.b' (matched by value to 'fc1.bias')" in v.report.compared
    assert not v.report.not_compared and not v.report.warnings


def test_a_wrong_gradient_in_a_renamed_parameter_is_caught():
    model = MLP(7, 13)
    sch = schedlang.create_schedule(model)
    with pytest.raises(schedlang.VerificationError, match=r"gradient of parameter 'fc1.w' \(matched by value to "
                                                          r"'fc1.weight'\): max abs diff"):
        with schedlang.Verify(sch, example_inputs=[torch.randn(5, 7)]):
            sch["fc1"].replace(RenamedLinear(model.fc1, grad_scale=0.5))


def test_parameters_without_counterpart_warn_both_ways():
    model = MLP(7, 13)
    sch = schedlang.create_schedule(model)

    class Gated(nn.Module):
        """fc1 wrapped with an extra parameter that nobody can map; forward unchanged."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.gate = nn.Parameter(torch.randn(3, 13))

        def forward(self, x):
            return self.inner(x) + 0 * self.gate.sum()

    wrapped = Gated(nn.Linear(7, 13))
    wrapped.inner.load_state_dict(model.fc1.state_dict())
    with pytest.warns(VerifyWarning) as record:
        with schedlang.Verify(sch, example_inputs=[torch.randn(5, 7)]) as v:
            sch["fc1"].replace(wrapped)
    assert v.report.passed
    assert v.report.not_compared == ["fc1.gate"]
    texts = [str(w.message) for w in record]
    assert any("parameter 'fc1.gate' (3, 13) of the scheduled model has no counterpart in the original model" in t
               and "its gradient was not compared" in t for t in texts)
    assert "not compared (no counterpart in the original model): fc1.gate" in str(v.report)
    assert "gradient of parameter 'fc1.inner.weight' (matched by value to 'fc1.weight')" in v.report.compared
    from schedlang.report.collect import collect
    from schedlang.report.page import render

    data = collect(sch, verify_report=v.report)
    assert any("'fc1.gate'" in w for w in data.verify["warnings"])
    assert "warning: parameter &#x27;fc1.gate&#x27; (3, 13) of the scheduled model has no counterpart" in render(data)


def test_an_original_parameter_left_without_counterpart_is_warned_about():
    model = MLP(7, 13)
    sch = schedlang.create_schedule(model)

    class NoBias(nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.weight = nn.Parameter(linear.weight.detach().clone())
            self.register_buffer("fixed_bias", linear.bias.detach().clone())

        def forward(self, x):
            return nn.functional.linear(x, self.weight, self.fixed_bias)

    with pytest.warns(VerifyWarning) as record:
        with schedlang.Verify(sch, example_inputs=[torch.randn(5, 7)]) as v:
            sch["fc1"].replace(NoBias(model.fc1))
    assert sorted(str(w.message) for w in record) == [
        "Verify: buffer 'fc1.fixed_bias' (13,) of the scheduled model has no counterpart in the original model: its "
        "value was not compared",
        "Verify: parameter 'fc1.bias' of the original model has no counterpart in the scheduled model: its gradient "
        "was not compared"]
    assert v.report.passed and v.report.not_compared == ["fc1.fixed_bias"]


class FrozenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 10)
        self.embed.requires_grad_(False)
        self.norm = nn.BatchNorm1d(10)
        self.head = nn.Linear(10, 4)

    def forward(self, x):
        return self.head(self.norm(self.embed(x)))


def test_frozen_parameters_and_buffers_are_compared():
    sch = schedlang.create_schedule(FrozenNet())
    with schedlang.Verify(sch, example_inputs=[torch.randn(8, 6)]) as v:
        sch["head"].decompose()
    assert "value of frozen parameter 'embed.weight'" in v.report.compared
    assert "value of buffer 'norm.running_mean'" in v.report.compared  # updated by the training pass
    assert "value of buffer 'norm.num_batches_tracked'" in v.report.compared


class UnfreezeAndSkipStats(nn.Module):
    """embed trainable again, and a norm that never updates its running statistics."""

    def __init__(self, net: FrozenNet):
        super().__init__()
        self.linear = nn.Linear(6, 10)
        self.linear.load_state_dict(net.embed.state_dict())

    def forward(self, x):
        return self.linear(x)


def test_unfrozen_parameter_and_stale_buffer_are_caught():
    net = FrozenNet()
    sch = schedlang.create_schedule(net)
    with pytest.raises(schedlang.VerificationError) as info:
        with schedlang.Verify(sch, example_inputs=[torch.randn(8, 6)]):
            sch["embed"].replace(UnfreezeAndSkipStats(net))
    assert "parameter 'embed.linear.weight' (matched by value to 'embed.weight') is trainable but the original's is " \
           "frozen" in str(info.value)

    class FrozenStats(nn.BatchNorm1d):
        def forward(self, x):  # right outputs, but the running statistics are never updated
            if self.training:
                return nn.functional.batch_norm(x, None, None, self.weight, self.bias, True)
            return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False)

    sch = schedlang.create_schedule(net)
    stale = FrozenStats(10)
    stale.load_state_dict(net.norm.state_dict())
    with pytest.raises(schedlang.VerificationError) as info:
        with schedlang.Verify(sch, example_inputs=[torch.randn(8, 6)]):
            sch["norm"].replace(stale)
    mismatches = str(info.value).split("steps applied")[0].splitlines()[1:]
    assert [m.split(":")[0].strip() for m in mismatches] == [
        "value of buffer 'norm.running_mean' (matched by name and value)",
        "value of buffer 'norm.running_var' (matched by name and value)",
        "value of buffer 'norm.num_batches_tracked' (matched by name and value)"]

"""Verify's tolerances: per dtype, a few half-precision outliers when the whole tensor is close, never a
pass on a moved tensor; non-finite references and bad example inputs are reported as such."""

import re

import pytest
import torch
from torch import nn

import schedlang
from schedlang.verify import ExampleInputError, tolerance_for
from schedlang.verify.compare import compare_tensors
from tests.helpers.distributed import run_distributed
from tests.helpers.models import MLP


# a few times outside the elementwise bound (atol x max|expected| + rtol x |expected|)
_SHIFT = {torch.float16: 0.004, torch.bfloat16: 0.05, torch.float32: 1e-3}


def _with_outliers(dtype, n_outliers, size=(13, 77), shift=None):
    shift = _SHIFT[dtype] if shift is None else shift
    g = torch.Generator().manual_seed(0)
    expected = torch.randn(size, generator=g).to(dtype)
    actual = expected.clone()
    flat = actual.view(-1)
    flat[:n_outliers] = flat[:n_outliers] + shift * expected.abs().max()
    return actual, expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accepts_a_single_outlier_when_the_tensor_is_close(dtype):
    actual, expected = _with_outliers(dtype, 1)
    assert compare_tensors("t", actual, expected, tolerance_for(dtype)) is None
    # the same outlier with the allowance turned off (explicit tolerances) is reported
    msg = compare_tensors("t", actual, expected, tolerance_for(dtype, rtol=1e-2, atol=1e-3))
    assert msg is not None and "1 of 1001 elements outside" in msg


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rejects_many_outliers_or_a_far_outlier(dtype):
    actual, expected = _with_outliers(dtype, 30)  # 3% of the elements
    msg = compare_tensors("t", actual, expected, tolerance_for(dtype))
    assert msg is not None and "relative error of the whole tensor" in msg
    assert int(re.search(r"(\d+) of 1001 elements outside", msg).group(1)) > 10  # more than 1%
    actual, expected = _with_outliers(dtype, 1, shift=2.0)  # one element far off
    assert compare_tensors("t", actual, expected, tolerance_for(dtype)) is not None


def test_half_precision_rejects_a_small_shift_of_the_whole_tensor():
    g = torch.Generator().manual_seed(1)
    expected = torch.randn(7, 13, generator=g).to(torch.float16)
    actual = (expected.float() * 1.03).to(torch.float16)  # 3% off everywhere: a wrong scale
    msg = compare_tensors("t", actual, expected, tolerance_for(torch.float16))
    assert msg is not None and "allowed 0.00293" in msg


def test_float32_allows_no_outlier():
    actual, expected = _with_outliers(torch.float32, 1)
    assert compare_tensors("t", actual, expected, tolerance_for(torch.float32)) is not None


def test_norm_bound_grows_slowly_with_the_reduction_length():
    short, long = tolerance_for(torch.bfloat16, reduction_size=64), tolerance_for(torch.bfloat16, reduction_size=65536)
    eps = torch.finfo(torch.bfloat16).eps
    assert short.norm_rtol == pytest.approx(3 * eps) and long.norm_rtol == pytest.approx(6 * eps)


def test_nan_in_the_scheduled_model_only_is_a_mismatch():
    expected = torch.randn(5, 3)
    actual = expected.clone()
    actual[2, 1] = float("nan")
    msg = compare_tensors("output", actual, expected, tolerance_for(torch.float32))
    assert msg == "output: contains NaN where the original has none (1 NaN of 15 elements)"


class Overflowing(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.exp(self.fc(x) * 1000)


def test_non_finite_reference_is_reported_as_the_inputs_fault_not_a_pass():
    sch = schedlang.create_schedule(Overflowing())
    x = torch.full((2, 4), 3.0) + torch.randn(2, 4) * 0.1
    with torch.no_grad():
        sch.mod.fc.weight.fill_(1.0)
    sch = schedlang.create_schedule(sch.mod)
    with pytest.raises(ExampleInputError, match=r"the original model gives non-finite values on the example inputs "
                                                r"\(eval mode\): output \(\d+ inf of 8 elements\)"):
        with schedlang.Verify(sch, example_inputs=[x]):
            sch["fc"].decompose()
    assert len(sch.plan) == 0


def test_inputs_the_original_rejects_are_the_inputs_fault():
    sch = schedlang.create_schedule(MLP())
    with pytest.raises(ExampleInputError) as info:
        with schedlang.Verify(sch, example_inputs=[torch.randn(3, 5)]):
            sch["fc1"].decompose()
    assert isinstance(info.value, schedlang.SchedlangError) and isinstance(info.value, ValueError)
    assert str(info.value).startswith("Verify: the original model itself fails on the example inputs (eval mode): "
                                      "RuntimeError: mat1 and mat2 shapes cannot be multiplied (3x5 and 12x20)")
    assert str(info.value).endswith("pass inputs the unscheduled model accepts")
    assert len(sch.plan) == 0 and type(sch["fc1"].mod) is nn.Linear


def _gpt2_world2(rank, world):
    from transformers import GPT2Config, GPT2LMHeadModel

    from schedlang.models import shard_gpt2

    results = {}
    for dtype_name, seed, planted in [("float16", 1, False), ("float16", 1, True)]:
        torch.manual_seed(seed)
        cfg = GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=512, n_positions=64, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg).to(getattr(torch, dtype_name))
        sch = schedlang.create_schedule(model)
        ids = torch.randint(0, 512, (2, 16))
        try:
            with schedlang.Verify(sch, example_inputs=[ids], check_training=False) as v:
                if planted:  # c_fc split along its inputs: wrong
                    mlp = sch["transformer.h.1.mlp"]
                    mlp["c_fc"].shard("weight", axis=0)
                    mlp["c_proj"].shard("weight", axis=0)
                    mlp["c_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
                    mlp.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
                else:
                    shard_gpt2(sch, gather_logits=True)
            results[(dtype_name, seed, planted)] = (True, list(v.report.compared))
        except schedlang.VerificationError as e:
            results[(dtype_name, seed, planted)] = (False, str(e))
    return results


def test_tensor_parallel_gpt2_in_half_precision_passes_and_a_planted_bug_does_not():
    # seed 1 failed on one element of a LayerNorm gradient with elementwise tolerances only
    for r in run_distributed(_gpt2_world2, world_size=2, timeout=300):
        assert r[("float16", 1, False)][0], r[("float16", 1, False)][1]
        compared = r[("float16", 1, False)][1]
        assert "output.logits" in compared and "gradient of parameter 'transformer.h.0.ln_1.weight'" in compared
        caught, text = r[("float16", 1, True)]
        assert not caught and "shard at 'transformer.h.1.mlp.c_fc' (tensor_name='weight', axis=0)" in text

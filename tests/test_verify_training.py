"""Verify in training mode: dropout on, random streams, activation checkpointing, forked streams.

Each schedule below is wrong only while dropout draws masks, so an eval-mode check passes it.
"""

import warnings

import pytest
import torch
from torch import nn

import schedlang
from tests.helpers.distributed import run_distributed


class DropMLP(nn.Module):
    def __init__(self, hidden=12, inner=20, p=0.5):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


class Layer(nn.Module):
    def __init__(self, hidden=12, inner=20):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = DropMLP(hidden, inner)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, hidden=12, inner=20):
        super().__init__()
        self.layer = Layer(hidden, inner)
        self.head = nn.Linear(hidden, 5)

    def forward(self, x):
        return self.head(self.layer(x))


def _verify(sch, x, fn):
    with schedlang.Verify(sch, example_inputs=[x]) as v:
        fn(sch)
    return v.report


def test_checkpoint_without_preserved_rng_state_over_a_dropout_is_caught():
    sch = schedlang.create_schedule(Net())
    x = torch.randn(6, 12)
    with pytest.raises(schedlang.VerificationError) as info:
        _verify(sch, x, lambda s: s["layer"].checkpoint(preserve_rng_state=False))
    text = str(info.value)
    assert "training mode: gradient of parameter 'layer.mlp.fc1.weight': max abs diff" in text
    assert "training mode: recomputed module 'layer.mlp.drop' (Dropout) does not reproduce its forward output" in text
    assert "the difference arises in backward" in text
    # eval mode alone passes it: the mismatch is only in training mode
    assert not any(line.strip().startswith(("output", "gradient", "input")) for line in text.splitlines())
    assert len(sch.plan) == 0  # the failed block left nothing behind


def test_fork_rng_on_an_mlp_inside_a_checkpointed_layer_is_caught():
    sch = schedlang.create_schedule(Net())
    x = torch.randn(6, 12)

    def schedule(s):
        s["layer.mlp"].fork_rng()
        s["layer"].checkpoint()

    with pytest.raises(schedlang.VerificationError) as info:
        _verify(sch, x, schedule)
    text = str(info.value)
    assert "training mode: recomputed module 'layer.mlp.drop' (Dropout) does not reproduce its forward output" in text
    assert "training mode: input[0] gradient: max abs diff" in text
    assert len(sch.plan) == 0


def test_correct_checkpoint_and_fork_pass_and_compare_with_the_original_in_training_mode():
    x = torch.randn(6, 12)
    report = _verify(schedlang.create_schedule(Net()), x, lambda s: s["layer"].checkpoint())
    assert "training mode compared with the original under seed 0" in report.notes
    assert "training mode: gradient of parameter 'layer.mlp.fc1.weight'" in report.compared
    assert "training mode: output" in report.compared
    report = _verify(schedlang.create_schedule(Net()), x, lambda s: s["layer.mlp"].fork_rng())
    assert report.passed and not report.warnings
    assert any("forked streams at layer.mlp mirrored" in n for n in report.notes)
    assert "training mode: gradient of parameter 'layer.norm.weight'" in report.compared


def test_verify_leaves_the_callers_random_stream_alone():
    sch = schedlang.create_schedule(Net())
    torch.manual_seed(123)
    before = torch.get_rng_state()
    _verify(sch, torch.randn(6, 12, generator=torch.Generator().manual_seed(0)), lambda s: s["layer"].checkpoint())
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.initial_seed() == 123


def test_training_pass_can_be_turned_off():
    sch = schedlang.create_schedule(Net())
    with schedlang.Verify(sch, example_inputs=[torch.randn(6, 12)], check_training=False) as v:
        sch["layer"].checkpoint(preserve_rng_state=False)
    assert v.report.passed and not any(c.startswith("training mode") for c in v.report.compared)


class ReplicatedDropout(nn.Module):
    """Linear -> Dropout -> Linear; nothing sharded: the dropout's input is the same on every rank."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 14)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(14, 10)

    def forward(self, x):
        return self.fc2(self.drop(self.fc1(x)))


def _megatron_with_forked_dropout(sch):
    sch["fc1"].shard("weight", axis=0)
    sch["fc1"].shard("bias", axis=0)
    sch["fc2"].shard("weight", axis=1)
    sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["drop"].fork_rng()  # the dropout sees this rank's shard of the activation


def _world2_training(rank, world):
    torch.manual_seed(rank)  # different weights and inputs per rank: Verify uses rank 0's
    x = torch.randn(4, 10)
    result = {}
    sch = schedlang.create_schedule(ReplicatedDropout())
    try:
        with schedlang.Verify(sch, example_inputs=[x]):
            sch["drop"].fork_rng()  # wrong: the masks of a replicated activation must agree
        result["replicated_fork"] = None
    except schedlang.VerificationError as e:
        result["replicated_fork"] = str(e)
    result["replicated_fork_plan"] = len(sch.plan)
    sch = schedlang.create_schedule(ReplicatedDropout())
    with schedlang.Verify(sch, example_inputs=[x]) as v:
        _megatron_with_forked_dropout(sch)
    result["tp_fork"] = (v.report.passed, list(v.report.notes), list(v.report.compared))
    sch = schedlang.create_schedule(ReplicatedDropout())
    with schedlang.Verify(sch, example_inputs=[x]) as v:
        sch["fc1"].shard("weight", axis=0)
        sch["fc1"].shard("bias", axis=0)
        sch["fc2"].shard("weight", axis=1)
        sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        sch["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    result["tp_plain_notes"] = list(v.report.notes)
    return result


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2_training, world_size=2, timeout=180)


def test_fork_rng_on_a_replicated_dropout_is_caught_across_ranks(world2):
    for r in world2:
        text = r["replicated_fork"]
        assert text is not None, "Verify accepted forked masks on a replicated activation"
        assert "training mode: output: max abs diff" in text
        assert "differs from rank 0's copy, but it must be the same on every rank" in text
        assert "on rank 1" in text
        assert r["replicated_fork_plan"] == 0


def test_tensor_parallel_mlp_with_forked_sharded_dropout_passes(world2):
    for r in world2:
        passed, notes, compared = r["tp_fork"]
        assert passed
        assert any("draws other random numbers than the original" in n and "forked streams at drop" in n
                   and "replicated tensors agree across ranks" in n for n in notes), notes
        assert "training mode: output (across ranks)" in compared
        assert "training mode: gradient of parameter 'fc2.bias' (across ranks)" in compared
        assert "training mode: input[0] gradient (across ranks)" in compared


def test_tensor_parallel_mlp_without_fork_draws_shard_sized_masks(world2):
    # the masks are drawn at the shard's size, so the original's stream cannot be matched
    for r in world2:
        assert any("draws other random numbers than the original" in n for n in r["tp_plain_notes"])


@pytest.mark.gpu
def test_training_mode_on_cuda_draws_from_the_cuda_stream():
    x = torch.randn(6, 12, device="cuda")
    sch = schedlang.create_schedule(Net().cuda())
    with schedlang.Verify(sch, example_inputs=[x]) as v:
        sch["layer"].checkpoint()
    assert "training mode compared with the original under seed 0" in v.report.notes
    sch = schedlang.create_schedule(Net().cuda())
    with pytest.raises(schedlang.VerificationError, match="training mode: recomputed module 'layer.mlp.drop'"):
        with schedlang.Verify(sch, example_inputs=[x]):
            sch["layer"].checkpoint(preserve_rng_state=False)


class FunctionalDropout(nn.Module):
    """Dropout written as F.dropout(..., self.training): the traced graph follows the mode."""

    def __init__(self, hidden=12, inner=20):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x):
        return self.fc2(nn.functional.dropout(torch.relu(self.fc1(x)), 0.3, self.training))


class TrainingOnlyDropout(FunctionalDropout):
    """Dropout behind ``if self.training``: a traced graph of it holds one mode's operations."""

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.training:
            h = nn.functional.dropout(h, 0.3)
        return self.fc2(h)


class FunctionalDropoutNet(nn.Module):
    def __init__(self, block=TrainingOnlyDropout):
        super().__init__()
        self.first = block()
        self.second = block()
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        return self.head(self.second(self.first(x)))


def _mode_fixed_schedule(mode: str, block=TrainingOnlyDropout):
    torch.manual_seed(0)
    model = FunctionalDropoutNet(block)
    getattr(model, mode)()
    return schedlang.create_schedule(model), torch.randn(3, 7, 12)


def test_a_graph_with_functional_dropout_traced_in_training_mode_is_verified_in_both_modes():
    sch, x = _mode_fixed_schedule("train", block=FunctionalDropout)
    verify = schedlang.Verify(sch, example_inputs=[x])
    with warnings.catch_warnings():
        warnings.simplefilter("error", schedlang.verify.VerifyWarning)
        with verify:
            sch["first"].trace()
    assert any(n.startswith("training mode compared with the original") for n in verify.report.notes)
    assert any(c.startswith("training mode: ") for c in verify.report.compared)
    assert any(not c.startswith("training mode: ") and not c.startswith("buffer") for c in verify.report.compared)


def test_a_graph_traced_in_training_mode_is_verified_in_training_mode_with_a_warning():
    sch, x = _mode_fixed_schedule("train")
    verify = schedlang.Verify(sch, example_inputs=[x])
    with pytest.warns(schedlang.verify.VerifyWarning,
                      match=r"eval mode not checked: 'first' were traced in training mode"):
        with verify:
            sch["first"].trace()
    assert any(n.startswith("training mode compared with the original") for n in verify.report.notes)
    assert any(c.startswith("training mode: ") for c in verify.report.compared)
    assert not any(not c.startswith("training mode: ") and not c.startswith("buffer") for c in verify.report.compared)


def test_a_wrong_step_beside_a_training_mode_graph_is_still_caught():
    sch, x = _mode_fixed_schedule("train")
    with pytest.raises(schedlang.VerificationError, match=r"training mode: output"):
        with pytest.warns(schedlang.verify.VerifyWarning, match="eval mode not checked"):
            with schedlang.Verify(sch, example_inputs=[x]):
                sch["first"].trace()
                sch["head"].replace(nn.Linear(12, 5))  # other weights: the outputs differ
    assert len(sch.plan.steps) == 0  # the block is undone


def test_a_graph_traced_in_eval_mode_is_verified_in_eval_mode_with_a_warning():
    sch, x = _mode_fixed_schedule("eval")
    verify = schedlang.Verify(sch, example_inputs=[x])
    with pytest.warns(schedlang.verify.VerifyWarning,
                      match=r"training mode not checked: 'first' were traced in eval mode"):
        with verify:
            sch["first"].trace()
    assert verify.report.compared and not any(c.startswith("training mode: ") for c in verify.report.compared)


def test_verify_refuses_a_schedule_it_cannot_run_in_any_checked_mode():
    sch, x = _mode_fixed_schedule("train")
    with pytest.raises(schedlang.VerificationError,
                       match=r"Verify: nothing to compare: 'first' run only in training mode"):
        with schedlang.Verify(sch, example_inputs=[x], check_training=False):
            sch["first"].trace()
    torch.manual_seed(0)
    model = FunctionalDropoutNet().train()
    model.second.eval()  # a model may hold modules in different modes on purpose
    sch = schedlang.create_schedule(model)
    with pytest.raises(schedlang.VerificationError,
                       match=r"Verify: the scheduled model runs in neither mode: 'first' only in training mode and "
                             r"'second' only in eval mode"):
        with schedlang.Verify(sch, example_inputs=[x]):
            sch["first"].trace()
            sch["second"].trace()

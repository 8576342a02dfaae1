import pytest
import torch

import schedlang
from schedlang.distributed.sync_ops import SyncOp
from tests.helpers.models import MLP


@pytest.mark.parametrize("mode", ["fwd_pre", "fwd_post", "bwd_post"])
def test_sync_inserts_a_named_leaf_and_is_identity_on_one_rank(mode):
    model = MLP(7, 13)
    sch = schedlang.create_schedule(model)
    sch["fc1"].sync(mode, "all_reduce")
    child = getattr(sch["fc1"].mod, f"_schedlang_sync_{mode}_0")
    assert isinstance(child, SyncOp)
    assert "fc1" in sch.child and list(sch["fc1"].child) == []  # sync modules are not schedule children
    x = torch.randn(5, 7, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    model(x).sum().backward()
    sch.mod(x2).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)


def test_callable_sync_runs_in_the_right_place():
    calls = []

    def record(t):
        calls.append(tuple(t.shape))
        return t * 2

    model = MLP(6, 10)
    sch = schedlang.create_schedule(model)
    sch["fc1"].sync("fwd_post", record)
    x = torch.randn(3, 6)
    out = sch.mod(x)
    assert calls == [(3, 10)]
    expected = model.fc2(model.act(model.fc1(x) * 2))
    torch.testing.assert_close(out, expected)


def test_sync_with_tuple_output_applies_to_first_element():
    class Pair(torch.nn.Module):
        def forward(self, x):
            return x + 1, x

    sch = schedlang.create_schedule(Pair())
    sch.sync("fwd_post", lambda t: -t)
    a, b = sch.mod(torch.ones(2))
    assert torch.equal(a, -2 * torch.ones(2)) and torch.equal(b, torch.ones(2))


@pytest.mark.parametrize("kwargs,message", [
    (dict(mode="fwd", sync_op_or_fn="all_reduce"),
     r"fc1: invalid sync mode 'fwd': valid modes are fwd_pre, fwd_post, bwd_post"),
    (dict(mode=3, sync_op_or_fn="all_reduce"),
     r"fc1: sync mode must be a str, got 3; valid modes are fwd_pre, fwd_post, bwd_post"),
    (dict(mode="fwd_post", sync_op_or_fn="broadcast"),
     r"fc1: invalid sync op 'broadcast': valid ops are all_reduce, all_gather, reduce_scatter, a resharding scheme "
     r"\(RR->RR, RS->RS, SR->SR, RR->RS, RR->SR, RS->RR, SR->RR, RS->SR, SR->RS\), or a callable"),
    (dict(mode="fwd_post", sync_op_or_fn="all_gather"), r"fc1: sync op 'all_gather' needs axis=<int>"),
    (dict(mode="fwd_post", sync_op_or_fn="reduce_scatter", axis="1"), r"fc1: sync axis must be an int, got '1'"),
    (dict(mode="fwd_post", sync_op_or_fn="all_reduce", axis=1), r"fc1: sync op 'all_reduce' takes no axis"),
    (dict(mode="fwd_post", sync_op_or_fn="all_reduce", group=3),
     r"fc1: unknown sync option\(s\) group: valid options are axis, tensor_parallel_output_grad"),
])
def test_bad_sync_arguments(kwargs, message):
    sch = schedlang.create_schedule(MLP())
    with pytest.raises(schedlang.SyncError, match=message):
        sch["fc1"].sync(**kwargs)
    assert len(sch.plan) == 0 and not hasattr(sch["fc1"].mod, "_schedlang_sync_fwd_post_0")


def test_sync_error_is_a_value_error():
    sch = schedlang.create_schedule(MLP())
    with pytest.raises(ValueError):
        sch["fc1"].sync("nope", "all_reduce")


def test_axis_out_of_range_fails_at_the_first_forward_before_any_collective():
    sch = schedlang.create_schedule(MLP(7, 13))
    sch["fc1"].sync("fwd_post", "all_gather", axis=7)  # the output's rank is not known yet
    with pytest.raises(schedlang.SyncError, match=r"^fc1: cannot all_gather along axis 7 at fwd_post: the module's "
                                                  r"output has shape \(5, 13\), so valid axes are 0, 1 "
                                                  r"\(or -2, -1\)$"):
        sch.mod(torch.randn(5, 7))
    ok = schedlang.create_schedule(MLP(7, 13))
    ok["fc1"].sync("fwd_pre", "reduce_scatter", axis=-2)
    torch.testing.assert_close(ok.mod(torch.randn(5, 7)).shape, torch.Size([5, 7]))


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


@pytest.mark.parametrize("meta", [False, True])
def test_axis_out_of_range_in_a_transformers_model_fails_at_call_time(meta):
    pytest.importorskip("transformers")
    if meta:
        with schedlang.init_empty_weights():
            model = _tiny_llama()
    else:
        model = _tiny_llama()
    sch = schedlang.create_schedule(model)
    sch["model.layers.0.mlp.up_proj"].shard("weight", axis=0)
    with pytest.raises(schedlang.SyncError, match=r"^model\.layers\.0\.mlp\.down_proj: cannot all_gather along axis 7 "
                                                  r"at fwd_post: the module's output has 3 dimensions, so valid axes "
                                                  r"are 0, 1, 2 \(or -3, -2, -1\)$"):
        sch["model.layers.0.mlp.down_proj"].sync("fwd_post", "all_gather", axis=7)
    with pytest.raises(schedlang.SyncError, match=r"^model\.embed_tokens: cannot reduce_scatter along axis 2 at "
                                                  r"bwd_post: the module's input \(whose gradient it applies to\) has 2 "
                                                  r"dimensions, so valid axes are 0, 1 \(or -2, -1\)$"):
        sch["model.embed_tokens"].sync("bwd_post", "reduce_scatter", axis=2)
    assert len(sch.plan) == 1
    sch["model.layers.0.mlp.down_proj"].sync("fwd_post", "all_gather", axis=-1)
    assert len(sch.plan) == 2


def test_sync_refuses_a_class_or_a_function_that_cannot_take_one_tensor():
    from torch import nn

    sch = schedlang.create_schedule(MLP(6, 10))
    with pytest.raises(schedlang.SyncError, match=r"^fc1: sync got the class ReLU as its function; pass an instance "
                                                  r"\(ReLU\(...\)\) or a function fn\(tensor\) -> tensor"):
        sch["fc1"].sync("fwd_post", nn.ReLU)  # would make ReLU(inplace=<tensor>) at the first forward

    def scale(t, factor):
        return t * factor

    with pytest.raises(schedlang.SyncError, match=r"^fc1: sync function scale cannot be called with one tensor "
                                                  r"\(its signature is \(t, factor\): missing a required argument: "
                                                  r"'factor'\); give a function fn\(tensor\) -> tensor, or a hook fn\(module, input, output\)$"):
        sch["fc1"].sync("fwd_post", scale)
    assert len(sch.plan) == 0 and not list(sch["fc1"].mod.children())
    sch["fc1"].sync("fwd_post", nn.ReLU())  # a module instance, or a function of one tensor, is fine
    sch["fc1"].sync("fwd_post", lambda t, factor=2: t * factor)
    assert sch.mod(torch.randn(3, 6)).shape == (3, 6)


def test_the_same_collective_twice_at_one_point_is_refused():
    sch = schedlang.create_schedule(MLP(6, 10))
    sch["fc2"].sync("fwd_post", "all_reduce")
    with pytest.raises(schedlang.SyncError, match=r"^fc2: a all_reduce at fwd_post is already there \(its sync module "
                                                  r"'_schedlang_sync_fwd_post_0'\); a second one would apply it twice"):
        sch["fc2"].sync("fwd_post", "all_reduce")
    assert len(sch.plan) == 1 and len(list(sch["fc2"].mod.children())) == 1
    # another point, another op, or another axis is a different sync
    sch["fc2"].sync("bwd_post", "all_reduce")
    sch["fc1"].sync("fwd_post", "all_gather", axis=1)
    with pytest.raises(schedlang.SyncError, match="all_gather along axis 1 at fwd_post is already there"):
        sch["fc1"].sync("fwd_post", "all_gather", axis=1)
    sch["fc1"].sync("fwd_post", "all_gather", axis=0)
    assert len(sch.plan) == 4

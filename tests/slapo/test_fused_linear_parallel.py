"""Tensor-parallel ``schedlang.op`` Linears whose bias add is fused (``LinearWithDropout``,
``LinearWithAct``) and the GPT-2 / GPT-Neo helpers that shard Slapo's ``FusedMLP`` with them.

A row-parallel ``LinearWithDropout`` must compute ``dropout(all_reduce(x_local @ W_local.T) + b)``:
the bias added once, to the summed output, then the dropout, whose mask (drawn from the default
stream on the replicated output) must be the one the unsharded module draws under the same seed.
The error messages of the rule run in one process (``fake_group``); the numerics on two gloo ranks.
"""

import contextlib
from unittest import mock

import pytest
import torch
from torch import nn

import schedlang as slapo
import schedlang.distributed.groups as groups
from schedlang.distributed.shard_rules import find_shard_rule
from schedlang.distributed.shard_rules.linear_with_dropout import FusedBiasLinearShardRule
from schedlang.model_schedule import gpt2, gpt_neo
from schedlang.module_record import module_record, shard_specs
from schedlang.op import FusedMLP, LinearWithAct, LinearWithDropout, LinearWithSyncFunc
from tests.helpers.distributed import run_distributed


@contextlib.contextmanager
def fake_group(world, rank):
    with mock.patch.object(groups, "world_size", lambda group=None: world), \
            mock.patch.object(groups, "rank", lambda group=None: rank):
        yield


def test_the_fused_bias_linears_have_their_own_rule():
    for module in (LinearWithDropout(13, 10), LinearWithAct(13, 10), LinearWithSyncFunc(13, 10)):
        assert find_shard_rule(module) is FusedBiasLinearShardRule


def test_row_parallel_shard_records_that_the_forward_runs_the_syncs_before_the_bias():
    mlp = FusedMLP(12, 26, "gelu_new", resid_pdrop=0.1)
    with fake_group(2, 1):
        sch = slapo.create_schedule(mlp)
        sch["fc_out"].shard("weight", axis=1)
    local = sch["fc_out"].mod
    assert type(local) is LinearWithDropout   # no class change: the op's own forward handles it
    assert module_record(local).syncs_before_bias
    assert (local.in_features, local.out_features) == (13, 12)
    torch.testing.assert_close(local.weight, mlp.fc_out.weight[:, 13:])
    assert "bias" not in shard_specs(local)
    assert type(mlp.fc_out) is LinearWithDropout and not module_record(mlp.fc_out).syncs_before_bias


def test_fused_bias_linear_shard_errors_change_nothing():
    with fake_group(2, 0):
        sch = slapo.create_schedule(nn.Sequential(LinearWithDropout(14, 10), LinearWithAct(10, 6)))
        sch["0"].shard("weight", axis=1)
        with pytest.raises(slapo.ShardError, match=r"^0: cannot shard 'bias' of a row-parallel LinearWithDropout "
                                                   r"\(weight sharded along axis 1\): its bias is added once after "
                                                   r"the all-reduce; keep it whole$"):
            sch["0"].shard("bias", axis=0)
        assert sch["0"].mod.bias.shape == (10,)

        sch["1"].shard("bias", axis=0)
        with pytest.raises(slapo.ShardError, match=r"^1: cannot shard 'weight' along axis 1: 'bias' is already "
                                                   r"sharded along axis 0 \(column parallel\); a row-parallel "
                                                   r"LinearWithAct keeps its bias whole"):
            sch["1"].shard("weight", axis=1)
        assert sch["1"].mod.weight.shape == (6, 10)

    class OwnForward(LinearWithDropout):
        def forward(self, x):
            return super().forward(x) * 2

    with fake_group(2, 0):
        sch = slapo.create_schedule(nn.Sequential(OwnForward(14, 10)))
        with pytest.raises(slapo.ShardError, match=r"^0: cannot shard 'weight' along axis 1 of OwnForward: it "
                                                   r"overrides forward, so its bias cannot be added after the "
                                                   r"all-reduce; shard along axis 0"):
            sch["0"].shard("weight", axis=1)
        assert sch["0"].mod.weight.shape == (10, 14) and not module_record(sch["0"].mod).syncs_before_bias
        sch["0"].shard("weight", axis=0)   # column parallel needs no change to its forward
        assert sch["0"].mod.out_features == 5


# --------------------------------------------------------------------------- two ranks
def _random_biases(model):
    """HF initializes biases to zero, which would hide a bias added on every rank before the all-reduce."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    return model


def _gpt2(resid_pdrop):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=96, attn_pdrop=0.0,
                        resid_pdrop=resid_pdrop, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return _random_biases(tf.GPT2LMHeadModel(cfg)), cfg


def _gpt_neo():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=4, max_position_embeddings=16, vocab_size=96,
                          attention_types=[[["global", "local"], 1]], window_size=4, attention_dropout=0.0,
                          resid_dropout=0.0, embed_dropout=0.0)
    return _random_biases(tf.GPTNeoForCausalLM(cfg)), cfg


def _plain(tensor):
    """This rank's local values of a built model's (DTensor) parameter or gradient."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _parallel_fused_linears(rank, world):
    out = {}
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))

    # GPT-2: Slapo's replace_mlp, then shard_parameters(["mlp"]); Verify compares eval and training mode
    model, cfg = _gpt2(0.0)
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs={"input_ids": ids}) as verify:
        out["gpt2_replaced"] = gpt2.replace_mlp(sch["transformer"], cfg)
        out["gpt2"] = gpt2.shard_parameters(sch["transformer"], sch["lm_head"], cfg, ["mlp"])
    out["gpt2_notes"] = verify.report.notes
    fc_out = sch["transformer.h.1.mlp.fc_out"].mod
    out["gpt2_fc_out"] = (type(fc_out).__name__, fc_out.in_features, module_record(fc_out).syncs_before_bias)
    out["gpt2_annotated"] = gpt2.annotate_layernorm_and_bias(sch["transformer"])

    # GPT-Neo: attention (global layer only) and MLP replaced, then sharded with the embeddings
    model, cfg = _gpt_neo()
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs={"input_ids": ids}):
        gpt_neo.replace_attention_and_mlp(sch["transformer"], cfg, {"attn_op_name": "math"})
        out["gpt_neo"] = gpt_neo.shard_parameters(sch["transformer"], sch["lm_head"], cfg,
                                                  ["embed", "attention", "mlp"])

    # dropout > 0 in training mode: Verify compares with the original under its seed, and the built
    # model's logits equal the unsharded model's under the same seed on both ranks
    model, cfg = _gpt2(0.3)
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs={"input_ids": ids}) as verify:
        gpt2.replace_mlp(sch["transformer"], cfg)
        gpt2.shard_parameters(sch["transformer"], None, cfg, ["mlp"])
    out["dropout_notes"] = verify.report.notes
    built, _ = slapo.build(sch, init_weights=False)
    built.train()
    model.train()
    torch.manual_seed(11)   # tensor-parallel ranks share the default stream's seed
    got = built(ids).logits
    torch.manual_seed(11)
    want = model(ids).logits
    torch.manual_seed(12)
    other_mask = model(ids).logits
    out["dropout_logits"] = _plain(got).detach().tolist()
    out["dropout_matches_unsharded"] = torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    out["dropout_is_active"] = not torch.allclose(want, other_mask, atol=1e-3)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(5))
    got.backward(grad)
    want.backward(grad)
    local = built.transformer.h[0].mlp.fc_out
    weight_grad = _plain(local.weight.grad)
    cols = weight_grad.shape[1]
    full = model.transformer.h[0].mlp.c_proj.weight.grad.t()   # HF Conv1D: (in, out) -> Linear layout
    out["dropout_weight_grad"] = torch.allclose(weight_grad, full[:, rank * cols:(rank + 1) * cols],
                                                atol=1e-5, rtol=1e-4)
    out["dropout_bias_grad"] = torch.allclose(_plain(local.bias.grad), model.transformer.h[0].mlp.c_proj.bias.grad,
                                              atol=1e-5, rtol=1e-4)

    # a column-parallel LinearWithDropout (its outputs gathered) and a row-parallel LinearWithAct
    torch.manual_seed(1)
    net = nn.Sequential(LinearWithDropout(13, 10, p=0.2), nn.Linear(10, 14), LinearWithAct(14, 9, act_fn="gelu_new"))
    x = torch.randn(7, 13)
    sch = slapo.create_schedule(net)
    with slapo.Verify(sch, example_inputs=[x]):
        sch["0"].shard("weight", axis=0)
        sch["0"].shard("bias", axis=0)
        sch["0"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        sch["0"].sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-1, tensor_parallel_output_grad=False)
        sch["1"].shard("weight", axis=0)
        sch["1"].shard("bias", axis=0)
        sch["1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        sch["2"].shard("weight", axis=1)
        sch["2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    out["small"] = [type(m).__name__ for m in sch.mod]
    return out


@pytest.mark.slow
def test_fused_mlp_helpers_and_fused_bias_linears_on_two_ranks():
    results = run_distributed(_parallel_fused_linears, world_size=2, timeout=600)
    first = results[0]
    assert first["gpt2_replaced"] == 2 and first["gpt2"] == ["Shard 2 MLP layers"]
    assert "training mode compared with the original under seed 0" in first["gpt2_notes"]
    assert first["gpt2_fc_out"] == ("LinearWithDropout", 64, True)
    # weight and bias of ln_1 and ln_2 in both layers and of ln_f, and both row-parallel fc_out biases
    assert first["gpt2_annotated"] == 2 * 2 * 2 + 2 + 2
    assert first["gpt_neo"] == ["Shard input embedding and output embedding", "Shard 1 attention layers",
                                "Shard 2 MLP layers"]
    assert "training mode compared with the original under seed 0" in first["dropout_notes"]
    for result in results:
        assert result["dropout_is_active"]
        assert result["dropout_matches_unsharded"]
        assert result["dropout_weight_grad"] and result["dropout_bias_grad"]
    assert results[0]["dropout_logits"] == results[1]["dropout_logits"]   # the same mask on both ranks
    assert first["small"] == ["LinearWithDropout", "Linear", "LinearWithAct"]

"""Verify localizes a mismatch: the first module, in execution order, whose output diverges, its shapes on
both sides, and a hint when it is (inside) an attention whose head count disagrees with its shards."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import schedlang
from schedlang.distributed.shard_rules import ShardRule, register_shard_rule
from tests.helpers.distributed import run_distributed
from tests.helpers.models import MLP


class ToyAttention(nn.Module):
    """Self-attention that splits its projections with ``self.num_heads`` (no shard rule knows it)."""

    def __init__(self, hidden=64, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, t, _ = x.shape

        def heads(y):
            return y.view(b, t, self.num_heads, -1).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                           is_causal=True)
        return self.out_proj(a.transpose(1, 2).reshape(b, t, -1))


@register_shard_rule
class _ForgetfulToyAttentionRule(ShardRule):
    """A hand-written rule for ToyAttention that forgets its head count: it wins over the generic attention
    rule (which would set num_heads right), so the model computes with the global head count on split heads,
    the user bug Verify must locate."""

    module_types = (ToyAttention,)


class ToyBlock(nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.attn = ToyAttention(hidden)
        self.mlp = MLP(hidden, 96)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


def _shard_attention(attn, out="out_proj"):
    for name in ("q_proj", "k_proj", "v_proj"):
        attn[name].shard("weight", axis=0)
        attn[name].shard("bias", axis=0)
    attn[out].shard("weight", axis=1)
    attn[out].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    attn.sync(mode="bwd_post", sync_op_or_fn="all_reduce")


def _toy(rank, world):
    torch.manual_seed(0)
    sch = schedlang.create_schedule(ToyBlock())
    try:
        with schedlang.Verify(sch, example_inputs=[torch.randn(2, 6, 64)]):
            _shard_attention(sch["attn"])  # num_heads left at 4 while each rank holds 2 heads
    except schedlang.VerificationError as e:
        return str(e)
    return None


def _opt(rank, world):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, ffn_dim=128, vocab_size=96,
                    max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0,
                    pad_token_id=1)
    cfg._attn_implementation = "sdpa"
    sch = schedlang.create_schedule(OPTForCausalLM(cfg))
    ids = torch.randint(2, 96, (2, 8))
    error = None
    try:
        with schedlang.Verify(sch, example_inputs=[ids]):
            for i in range(2):
                layer = sch[f"model.decoder.layers.{i}"]
                _shard_attention(layer["self_attn"])
                layer["fc1"].shard("weight", axis=0)
                layer["fc1"].shard("bias", axis=0)
                layer["fc2"].shard("weight", axis=1)
                layer["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
                layer["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
            heads = sch["model.decoder.layers.0.self_attn"].mod.num_heads
    except schedlang.VerificationError as e:
        error = str(e)
        heads = None
    return error, heads, len(sch.plan)


class Fold(nn.Module):
    """Softmax within 4 groups of the features: the group count is fixed, so a split input is regrouped."""

    def forward(self, x):
        return x.view(*x.shape[:-1], 4, -1).softmax(-1).flatten(-2)


class FoldNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.fold = Fold()
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        return self.out(self.fold(self.proj(x)))


def _split(rank, world):
    torch.manual_seed(0)
    sch = schedlang.create_schedule(FoldNet())
    try:
        with schedlang.Verify(sch, example_inputs=[torch.randn(3, 16)]):
            sch["proj"].shard("weight", axis=0)
            sch["proj"].shard("bias", axis=0)
            sch["out"].shard("weight", axis=1)
            sch["out"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
            sch["proj"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    except schedlang.VerificationError as e:
        return str(e)
    return None


def _both(rank, world):
    return _toy(rank, world), _opt(rank, world), _split(rank, world)


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_both, world_size=2, timeout=240)


def test_stale_head_count_is_localized_with_a_hint(world2):
    for toy, _, _ in world2:
        assert toy is not None, "Verify accepted an attention that splits heads with the global head count"
        assert "first diverging module (in execution order): 'attn.out_proj' (" in toy
        assert "output shapes (2, 6, 64) here and (2, 6, 64) in the original; output: max abs diff" in toy
        assert ("hint: attention 'attn' (ToyAttention) reads num_heads=4 but its projections hold 2 heads per rank "
                "('q_proj' has 32 output features, head_dim=16, 64 in the original)") in toy


def test_opt_sharded_by_hand_without_fixing_num_heads(world2):
    for _, (error, heads, plan_length), _ in world2:
        if heads == 2:  # a shard rule for OPT attention set the local head count: then the schedule is right
            assert error is None
            continue
        assert error is not None, "Verify accepted OPT attention reading the global num_heads on a shard"
        assert "first diverging module (in execution order): 'model.decoder.layers.0.self_attn" in error
        assert ("hint: attention 'model.decoder.layers.0.self_attn' (OPTAttention) reads num_heads=4 but its "
                "projections hold 2 heads per rank") in error
        assert plan_length == 0


def test_a_reshape_of_a_split_activation_gets_a_hint(world2):
    for _, _, text in world2:
        assert text is not None, "Verify accepted a fixed group count over a split activation"
        assert "first diverging module (in execution order): 'out' (" in text
        assert ("hint: 'out' runs after 'fold' (Fold), whose output is this rank's part ((3, 8) here, (3, 16) in the "
                "original): a reshape or view in between that assumes the full size") in text


def test_a_wrong_activation_is_the_first_divergence_at_world_1():
    sch = schedlang.create_schedule(nn.Sequential(MLP(8, 16), MLP(8, 16)))
    with pytest.raises(schedlang.VerificationError) as info:
        with schedlang.Verify(sch, example_inputs=[torch.randn(3, 8)]):
            sch["1.act"].replace(nn.ReLU())
    text = str(info.value)
    assert ("first diverging module (in execution order): '1.act' (ReLU), output shapes (3, 16) here and (3, 16) in "
            "the original; output: max abs diff") in text
    assert "hint:" not in text


def test_a_backward_only_bug_says_so():
    from tests.test_verify import BrokenGELU

    sch = schedlang.create_schedule(MLP(7, 13))
    with pytest.raises(schedlang.VerificationError, match="every module output that can be compared agrees with the "
                                                          "original's; the difference arises in backward"):
        with schedlang.Verify(sch, example_inputs=[torch.randn(5, 7)]):
            sch["act"].replace(BrokenGELU())

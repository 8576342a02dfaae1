"""Shard rules for Embedding, HF Conv1D, norms and HF attention modules, and tie-aware sharding.

These run in one process: the schedule is told it is rank ``r`` of ``w`` (``fake_group``), which is
all that sharding needs. Each rank's module is then checked against the unsharded one: the sum
over ranks of the partial results (what the all-reduce computes), or the slice each rank must
hold. The collectives themselves are covered by the multi-process tests.
"""

import contextlib
import copy
from unittest import mock

import pytest
import torch
from torch import nn

import schedlang
import schedlang.distributed.groups as groups
from schedlang.distributed.shard_rules import ShardRule, register_shard_rule
from schedlang.distributed.shard_rules.embedding import VocabParallelEmbedding
from schedlang.module_record import module_record, shard_specs


@contextlib.contextmanager
def fake_group(world, rank):
    with mock.patch.object(groups, "world_size", lambda group=None: world), \
            mock.patch.object(groups, "rank", lambda group=None: rank):
        yield


def sharded(model, steps, world, rank):
    """A schedule of ``model`` as rank ``rank`` of ``world`` after ``steps(sch)``."""
    with fake_group(world, rank):
        sch = schedlang.create_schedule(model)
        steps(sch)
    return sch


# --------------------------------------------------------------------------- Embedding
@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_embedding_sums_to_the_full_lookup(world):
    emb = nn.Embedding(42, 10, padding_idx=23)
    ids = torch.randint(0, 42, (3, 7))
    cot = torch.randn(3, 7, 10)
    full = emb(ids)
    (full * cot).sum().backward()
    total = torch.zeros_like(full)
    for rank in range(world):
        sch = sharded(emb, lambda s: s.shard("weight", axis=0), world, rank)
        local = sch.mod
        rows = 42 // world
        assert isinstance(local, VocabParallelEmbedding) and local.num_embeddings == rows
        assert (local.vocab_start_index, local.vocab_end_index) == (rank * rows, (rank + 1) * rows)
        assert local.padding_idx == (23 - rank * rows if rank * rows <= 23 < (rank + 1) * rows else None)
        out = local(ids)
        outside = (ids < rank * rows) | (ids >= (rank + 1) * rows)
        assert out[outside].eq(0).all()
        (out * cot).sum().backward()
        torch.testing.assert_close(local.weight.grad, emb.weight.grad[rank * rows:(rank + 1) * rows])
        total += out.detach()
    torch.testing.assert_close(total, full.detach())


def test_hidden_parallel_embedding_gives_a_slice_of_the_hidden_size():
    emb = nn.Embedding(13, 8)
    ids = torch.randint(0, 13, (4, 5))
    for rank in range(2):
        local = sharded(emb, lambda s: s.shard("weight", axis=1), 2, rank).mod
        assert type(local) is nn.Embedding and local.embedding_dim == 4
        torch.testing.assert_close(local(ids), emb(ids)[..., rank * 4:(rank + 1) * 4])


def test_embedding_errors():
    with pytest.raises(schedlang.ShardError,
                       match=r"<root>: cannot shard 'weight' of an Embedding with max_norm=1.0 along the vocabulary "
                             r"\(axis 0\): renormalizing looked-up rows"):
        sharded(nn.Embedding(8, 4, max_norm=1.0), lambda s: s.shard("weight", axis=0), 2, 0)
    with pytest.raises(schedlang.ShardError,
                       match=r"<root>: cannot shard 'weight' of an Embedding with scale_grad_by_freq=True along the "
                             r"vocabulary \(axis 0\): the masked ids would be counted as local row 0"):
        sharded(nn.Embedding(8, 4, scale_grad_by_freq=True), lambda s: s.shard("weight", axis=0), 2, 0)


# --------------------------------------------------------------------------- Conv1D
def _conv1d(nx=12, nf=18):
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(nf, nx)
    with torch.no_grad():
        conv.bias.normal_()
    return conv


def test_column_parallel_conv1d_computes_a_slice_of_the_outputs():
    conv = _conv1d()
    x = torch.randn(2, 5, 12)
    for rank in range(3):
        local = sharded(conv, lambda s: (s.shard("weight", axis=1), s.shard("bias", axis=0)), 3, rank).mod
        assert (local.nx, local.nf) == (12, 6)
        torch.testing.assert_close(local(x), conv(x)[..., rank * 6:(rank + 1) * 6])


def test_row_parallel_conv1d_adds_its_bias_once_after_its_syncs():
    conv = _conv1d()
    x = torch.randn(2, 5, 12)
    partial_sum = torch.zeros(2, 5, 18)
    for rank in range(2):
        def steps(s):
            s.sync(mode="fwd_post", sync_op_or_fn=lambda t: t * 2)  # before the shard: moved inside the module
            s.shard("weight", axis=0)

        local = sharded(conv, steps, 2, rank).mod
        assert type(local).__name__ == "RowParallelConv1D" and (local.nx, local.nf) == (6, 18)
        assert module_record(local).syncs_before_bias and [s.child for s in module_record(local).syncs] == [
            "_schedlang_sync_fwd_post_0"] and not local._forward_hooks
        out = local(x[..., rank * 6:(rank + 1) * 6])
        partial_sum += (out - conv.bias).detach() / 2
    torch.testing.assert_close(partial_sum + conv.bias, conv(x))


def test_conv1d_errors():
    conv = _conv1d()
    with pytest.raises(schedlang.ShardError,
                       match=r"<root>: cannot shard 'bias' of a row-parallel Conv1D \(weight sharded along axis 0\): "
                             r"its bias is added once after the all-reduce; keep it whole"):
        sharded(conv, lambda s: (s.shard("weight", axis=0), s.shard("bias", axis=0)), 2, 0)
    with pytest.raises(schedlang.ShardError,
                       match=r"<root>: cannot shard 'weight' along axis 0 \(row parallel\): 'bias' is already sharded "
                             r"\(column parallel\); a row-parallel Conv1D keeps its bias whole"):
        sharded(conv, lambda s: (s.shard("bias", axis=0), s.shard("weight", axis=0)), 2, 0)


# --------------------------------------------------------------------------- GPT-2 attention
def _gpt2_attention(cross=False):
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    cfg = GPT2Config(n_embd=64, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0, add_cross_attention=cross)
    cfg._attn_implementation = "eager"
    attn = GPT2Attention(cfg, is_cross_attention=cross, layer_idx=0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2)
    return attn


def _shard_attention(s):
    s["c_attn"].shard("weight", axis=1)
    s["c_attn"].shard("bias", axis=0)
    s["c_proj"].shard("weight", axis=0)


def test_gpt2_fused_qkv_is_split_head_wise():
    attn = _gpt2_attention()
    x = torch.randn(2, 6, 64)
    expected = attn(x)[0]
    w = attn.c_attn.weight.detach()
    partial_sum = torch.zeros_like(expected)
    for rank in range(2):
        local = sharded(attn, _shard_attention, 2, rank).mod
        q, k, v = (w[:, i * 64 + rank * 32: i * 64 + (rank + 1) * 32] for i in range(3))
        torch.testing.assert_close(local.c_attn.weight, torch.cat([q, k, v], dim=1))
        spec = shard_specs(local.c_attn)["weight"]
        assert spec.groups == 3
        torch.testing.assert_close(spec.slice_of(w), local.c_attn.weight)
        assert (local.split_size, local.num_heads) == (32, 2)
        partial_sum += (local(x)[0] - attn.c_proj.bias).detach()
    torch.testing.assert_close(partial_sum + attn.c_proj.bias, expected)


def test_gpt2_head_wise_layout_is_derived_again_when_a_plan_is_replayed():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=32, n_positions=8,
                                       bos_token_id=0, eos_token_id=0))
    with fake_group(2, 1):
        sch = schedlang.create_schedule(model)
        _shard_attention(sch["transformer.h.0.attn"])
        replayed = schedlang.replay(sch.plan.to_json(), model)
    torch.testing.assert_close(replayed["transformer.h.0.attn.c_attn"].mod.weight,
                               sch["transformer.h.0.attn.c_attn"].mod.weight)
    assert "groups" not in sch.plan.to_json()


def test_gpt2_attention_errors():
    attn = _gpt2_attention()
    with pytest.raises(schedlang.ShardError,
                       match=r"c_attn: cannot shard 'weight' along axis 1 over 3 ranks: each of q, k and v in the "
                             r"fused projection has 4 heads of size 16 and every rank must hold whole heads; valid "
                             r"world sizes: 1, 2, 4"):
        sharded(attn, lambda s: s["c_attn"].shard("weight", axis=1), 3, 0)
    with pytest.raises(schedlang.ShardError,
                       match=r"c_proj: cannot shard 'weight' along axis 0 over 8 ranks: the input of the output "
                             r"projection has 4 heads of size 16"):
        sharded(attn, lambda s: s["c_proj"].shard("weight", axis=0), 8, 0)
    with pytest.raises(schedlang.ShardError,
                       match=r"c_attn: cannot shard 'weight': its parent is a cross-attention GPT2Attention, and only "
                             r"self-attention \(q\|k\|v fused in c_attn\) can be sharded head-wise"):
        sharded(_gpt2_attention(cross=True), lambda s: s["c_attn"].shard("weight", axis=1), 2, 0)


# --------------------------------------------------------------------------- LLaMA and BERT attention
def _llama_attention(heads=4, kv_heads=2):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    return LlamaAttention(LlamaConfig(hidden_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads), 0)


def test_llama_attention_follows_its_projections():
    def steps(s):
        for n in ("q_proj", "k_proj", "v_proj"):
            s[n].shard("weight", axis=0)
        s["o_proj"].shard("weight", axis=1)

    local = sharded(_llama_attention(heads=8, kv_heads=4), steps, 2, 1).mod
    assert (local.num_heads, local.num_key_value_heads, local.num_key_value_groups) == (4, 2, 2)
    assert local.q_proj.out_features == 32 and local.k_proj.out_features == 16


def test_llama_attention_errors():
    with pytest.raises(schedlang.ShardError,
                       match=r"^k_proj: cannot shard 'weight' along axis 0 over 4 ranks: the key projection has 2 "
                             r"heads of size 16 and every rank must hold whole heads; valid world sizes: 1, 2$"):
        sharded(_llama_attention(), lambda s: s["k_proj"].shard("weight", axis=0), 4, 0)
    with pytest.raises(schedlang.ShardError,
                       match=r"^o_proj: cannot shard 'weight' along axis 1 over 8 ranks: the input of the output "
                             r"projection has 4 heads of size 16"):
        sharded(_llama_attention(), lambda s: s["o_proj"].shard("weight", axis=1), 8, 0)


def test_bert_self_attention_follows_its_projections():
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention

    attn = BertSelfAttention(BertConfig(hidden_size=64, num_attention_heads=4))

    def steps(s):
        for n in ("query", "key", "value"):
            s[n].shard("weight", axis=0)
            s[n].shard("bias", axis=0)

    local = sharded(attn, steps, 2, 0).mod
    assert (local.num_attention_heads, local.all_head_size) == (2, 32)
    with pytest.raises(schedlang.ShardError, match=r"^value: cannot shard 'bias' along axis 0 over 8 ranks: the "
                                                   r"value projection has 4 heads"):
        sharded(attn, lambda s: s["value"].shard("bias", axis=0), 8, 0)


# --------------------------------------------------------------------------- norms
@pytest.mark.parametrize("make", [lambda: nn.LayerNorm(8), lambda: nn.RMSNorm(8)])
def test_norm_weights_are_never_split(make):
    with pytest.raises(schedlang.ShardError,
                       match=r"<root>: cannot shard 'weight' of (LayerNorm|RMSNorm): a norm normalizes over the whole "
                             r"hidden size, so its weights stay whole on every rank; for sequence parallelism use its "
                             r"sequence-parallel form"):
        sharded(make(), lambda s: s.shard("weight", axis=0), 2, 0)


# --------------------------------------------------------------------------- tied tensors and fused layouts
def test_sharding_a_tied_weight_shards_every_holder():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                                       bos_token_id=0, eos_token_id=0))
    sch = sharded(model, lambda s: s["transformer.wte"].shard("weight", axis=0), 2, 1)
    wte, head = sch["transformer.wte"].mod, sch["lm_head"].mod
    assert head.weight is wte.weight and wte.weight.shape == (16, 16)
    assert head.out_features == 16 and shard_specs(head)["weight"] == shard_specs(wte)["weight"]
    assert shard_specs(sch["lm_head"].mod)["weight"].rank == 1
    assert model.lm_head.weight is model.transformer.wte.weight and model.lm_head.weight.shape == (32, 16)
    # sharding the other holder the same way asks for what is done already (Slapo scripts do): nothing changes
    before = head.weight
    with fake_group(2, 1):
        sch["lm_head"].shard("weight", axis=0)
    assert sch["lm_head"].mod.weight is before and before.shape == (16, 16)
    # another axis is a second split of the shard: an error
    with pytest.raises(schedlang.ShardError, match=r"lm_head: 'weight' is already sharded \(along axis 0\)"):
        with fake_group(2, 1):
            sch["lm_head"].shard("weight", axis=1)


class _FusedParent(nn.Module):
    """Test-only parent whose rule asks for a 2-block layout of its child's outputs."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 18)


@register_shard_rule
class _FusedParentRule(ShardRule):
    module_type_names = ("_FusedParent",)

    @classmethod
    def check_child_shard(cls, path, module, child_name, child, tensor_name, axis, world_size):
        return 2


def test_fused_layout_errors():
    with pytest.raises(schedlang.ShardError,
                       match=r"^proj: cannot shard the fused tensor \(shape \(18, 3\), 2 blocks along axis 0\) over 2 "
                             r"ranks: each block of 9 must be divisible by 2$"):
        sharded(_FusedParent(), lambda s: s["proj"].shard("weight", axis=0), 2, 0)
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    holder = nn.Module()
    holder.attn = _gpt2_attention()
    holder.other = copy.deepcopy(holder.attn.c_attn)
    holder.other.weight = holder.attn.c_attn.weight
    assert isinstance(holder.attn, GPT2Attention)
    with pytest.raises(schedlang.ShardError,
                       match=r"^attn.c_attn: the tied tensor's holders need different fused layouts \(attn.c_attn: 3, "
                             r"other: 1\); shard them separately or untie them$"):
        sharded(holder, lambda s: s["attn.c_attn"].shard("weight", axis=1), 2, 0)


# --------------------------------------------------------------------------- syncs on keyword inputs
class _KeywordOnly(nn.Module):
    def forward(self, *, hidden_states=None, scale=1.0):
        return hidden_states * scale if hidden_states is not None else torch.zeros(1)


def test_pre_syncs_apply_to_keyword_inputs():
    sch = schedlang.create_schedule(_KeywordOnly())
    sch.sync(mode="fwd_pre", sync_op_or_fn=lambda t: t + 1)
    x = torch.randn(3)
    torch.testing.assert_close(sch.mod(hidden_states=x, scale=2.0), (x + 1) * 2)
    with pytest.raises(RuntimeError, match=r"_KeywordOnly: fwd_pre sync needs a tensor input"):
        sch.mod(scale=2.0)


# --------------------------------------------------------------------------- the generic attention / MLP rule
def _partial_sum(module, steps, world, x, row_bias=None, **call):
    """Sum over ranks of each rank's output (what the all-reduce computes), and the ranks' modules."""
    total, ranks = 0, []
    for rank in range(world):
        local = sharded(module, steps, world, rank).mod
        out = local(x, **call)
        out = out[0] if isinstance(out, tuple) else out
        total = total + (out - (row_bias if row_bias is not None else 0)).detach()
        ranks.append(local)
    return total + (row_bias if row_bias is not None else 0), ranks


def _rotary(cfg, x):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaRotaryEmbedding(cfg)
    return rope(x, torch.arange(x.shape[1]).unsqueeze(0))


def _random_weights(module):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module


def test_generic_rule_makes_a_hand_written_opt_attention_local():
    from transformers import OPTConfig
    from transformers.models.opt.modeling_opt import OPTAttention

    cfg = OPTConfig(hidden_size=64, num_attention_heads=4)
    cfg._attn_implementation = "eager"
    attn = _random_weights(OPTAttention(cfg, layer_idx=0).eval())
    x = torch.randn(2, 7, 64)

    def steps(s):
        for n in ("q_proj", "k_proj", "v_proj"):
            s[n].shard("weight", axis=0)
            s[n].shard("bias", axis=0)
        s["out_proj"].shard("weight", axis=1)

    total, ranks = _partial_sum(attn, steps, 2, x, row_bias=attn.out_proj.bias)
    torch.testing.assert_close(total, attn(x)[0])
    assert [m.num_heads for m in ranks] == [2, 2] and attn.num_heads == 4


def test_generic_rule_splits_phi3_fused_qkv_and_gate_up_per_part_with_a_local_config():
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3Attention, Phi3MLP

    cfg = Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=40,
                     pad_token_id=0)
    cfg._attn_implementation = "eager"
    attn = _random_weights(Phi3Attention(cfg, layer_idx=0).eval())
    x = torch.randn(2, 7, 64)
    call = dict(position_embeddings=_rotary(cfg, x), attention_mask=None)

    def steps(s):
        s["qkv_proj"].shard("weight", axis=0)
        s["o_proj"].shard("weight", axis=1)

    total, ranks = _partial_sum(attn, steps, 2, x, **call)
    torch.testing.assert_close(total, attn(x, **call)[0])
    for rank, local in enumerate(ranks):
        assert shard_specs(local.qkv_proj)["weight"].groups == 3
        assert local.config.num_attention_heads == 2 and local.num_key_value_heads == 2
        assert local.config is not attn.config and local.config.hidden_size == 64
    assert attn.config.num_attention_heads == 4 and attn.num_key_value_heads == 4

    mlp = _random_weights(Phi3MLP(cfg))

    def mlp_steps(s):
        s["gate_up_proj"].shard("weight", axis=0)
        s["down_proj"].shard("weight", axis=1)

    total, ranks = _partial_sum(mlp, mlp_steps, 2, x)
    torch.testing.assert_close(total, mlp(x))
    assert shard_specs(ranks[1].gate_up_proj)["weight"].groups == 2


def test_generic_rule_splits_gpt_neox_interleaved_qkv_contiguously():
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention, GPTNeoXRotaryEmbedding

    cfg = GPTNeoXConfig(hidden_size=64, num_attention_heads=4, attention_dropout=0.0)
    cfg._attn_implementation = "eager"
    attn = _random_weights(GPTNeoXAttention(cfg, layer_idx=0).eval())
    x = torch.randn(2, 7, 64)
    call = dict(attention_mask=None, position_embeddings=GPTNeoXRotaryEmbedding(cfg)(x, torch.arange(7)[None]))

    def steps(s):
        s["query_key_value"].shard("weight", axis=0)
        s["query_key_value"].shard("bias", axis=0)
        s["dense"].shard("weight", axis=1)

    total, ranks = _partial_sum(attn, steps, 2, x, row_bias=attn.dense.bias, **call)
    torch.testing.assert_close(total, attn(x, **call)[0])
    assert shard_specs(ranks[0].query_key_value)["weight"].groups == 1


def _gemma_attention(kv_heads=2):
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaAttention

    return GemmaAttention(GemmaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads,
                                      head_dim=16), layer_idx=0)


def test_generic_rule_errors():
    hint = (r"register a rule for it: a ShardRule subclass with module_type_names = \('{}',\) whose "
            r"check_child_shard / after_child_shard fix the module, decorated with "
            r"schedlang.distributed.shard_rules.register_shard_rule \(tutorials/07_new_family.py shows one\)")
    with pytest.raises(schedlang.ShardError,
                       match=r"^k_proj: cannot shard 'weight': the key/value projection has 2 heads, fewer than the 4 "
                             r"ranks; key/value heads are not replicated: use at most 2 ranks or a model with more "
                             r"key/value heads; GemmaAttention.forward reads head_dim=16, layer_idx=0; "
                             + hint.format("GemmaAttention") + "$"):
        sharded(_gemma_attention(), lambda s: s["k_proj"].shard("weight", axis=0), 4, 0)
    from transformers import OPTConfig
    from transformers.models.opt.modeling_opt import OPTAttention

    with pytest.raises(schedlang.ShardError,
                       match=r"^q_proj: cannot shard 'weight': the projection has 4 heads over 8 ranks: every rank "
                             r"must hold whole heads; valid world sizes: 1, 2, 4; OPTAttention.forward reads "
                             r"head_dim=16, layer_idx=0, num_heads=4; "):
        sharded(OPTAttention(OPTConfig(hidden_size=64, num_attention_heads=4), 0),
                lambda s: s["q_proj"].shard("weight", axis=0), 8, 0)
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3Attention

    gqa = Phi3Attention(Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0), 0)
    # q | k | v of unequal widths split part by part (tests/models/test_tp_unequal_blocks.py): refused only
    # where the key/value heads cannot be divided among the ranks
    with pytest.raises(schedlang.ShardError,
                       match=r"^qkv_proj: cannot shard 'weight': the fused q\|k\|v projection has 2 key/value heads, "
                             r"fewer than the 4 ranks; key/value heads are not replicated: use at most 2 ranks or a "
                             r"model with more key/value heads; Phi3Attention.forward reads config.num_attention_heads=4,"
                             r" head_dim=16, layer_idx=0, num_key_value_heads=2; " + hint.format("Phi3Attention")):
        sharded(gqa, lambda s: s["qkv_proj"].shard("weight", axis=0), 4, 0)
    from transformers import StableLmConfig
    from transformers.models.stablelm.modeling_stablelm import StableLmAttention

    per_head = StableLmAttention(StableLmConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                                qk_layernorm=True), 0)
    with pytest.raises(schedlang.ShardError,
                       match=r"^q_proj: cannot shard 'weight': its submodule 'q_layernorm.norms' holds one module per "
                             r"head \(4\), which the generic rule does not split"):
        sharded(per_head, lambda s: s["q_proj"].shard("weight", axis=0), 2, 0)
    with pytest.raises(schedlang.ShardError,
                       match=r"^proj: cannot shard 'weight': its forward reads groups_of_four=4, which matches the head "
                             r"geometry \(4 query heads, 4 key/value heads of size 8\) but has no meaning the generic "
                             r"rule knows; _Odd.forward reads groups_of_four=4, head_dim=8; "
                             + hint.format("_Odd")):
        sharded(_Odd(), lambda s: s["proj"].shard("weight", axis=0), 2, 0)
    with pytest.raises(schedlang.ShardError,
                       match=r"^fused: cannot shard 'weight': the layout of the fused q\|k\|v projection 'fused' cannot "
                             r"be told from the forward \(neither reshaped into heads nor split into parts first\)"):
        sharded(_Odd(), lambda s: s["fused"].shard("weight", axis=0), 2, 0)


class _Odd(nn.Module):
    """Test-only attention whose forward reads an integer the generic rule cannot interpret."""

    def __init__(self):
        super().__init__()
        self.head_dim, self.groups_of_four, self.hidden_size = 8, 4, 32
        self.proj = nn.Linear(32, 32)
        self.fused = nn.Linear(32, 96)
        self.out = nn.Linear(32, 32)

    def forward(self, x):
        y = self.proj(x).view(*x.shape[:-1], self.groups_of_four, self.head_dim)
        z = torch.sigmoid(self.fused(x)).sum(-1, keepdim=True)
        return self.out(y.flatten(-2) * z)


def test_generic_rule_leaves_the_users_model_and_config_untouched_when_it_refuses():
    attn = _gemma_attention()
    before = {n: p.clone() for n, p in attn.named_parameters()}
    with pytest.raises(schedlang.ShardError):
        sharded(attn, lambda s: (s["q_proj"].shard("weight", axis=0), s["k_proj"].shard("weight", axis=0)), 4, 0)
    assert all(torch.equal(before[n], p) for n, p in attn.named_parameters())
    assert attn.config.num_attention_heads == 4 and attn.q_proj.out_features == 64


def test_vocab_parallel_embedding_subclass_keeps_its_forward():
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding

    emb = GemmaTextScaledWordEmbedding(30, 8, padding_idx=0, embed_scale=3.0)
    ids = torch.randint(0, 30, (2, 9))
    total = sum(sharded(emb, lambda s: s.shard("weight", axis=0), 3, r).mod(ids).detach() for r in range(3))
    torch.testing.assert_close(total, emb(ids))
    local = sharded(emb, lambda s: s.shard("weight", axis=0), 3, 1).mod
    assert isinstance(local, VocabParallelEmbedding) and isinstance(local, GemmaTextScaledWordEmbedding)

    class _OwnLookup(nn.Embedding):
        def forward(self, ids):
            return F.embedding(ids, self.weight) * 2

    import torch.nn.functional as F

    with pytest.raises(schedlang.ShardError,
                       match=r"^<root>: cannot shard 'weight' of _OwnLookup along the vocabulary \(axis 0\): its "
                             r"forward does not look ids up through super\(\).forward"):
        sharded(_OwnLookup(10, 4), lambda s: s.shard("weight", axis=0), 2, 0)

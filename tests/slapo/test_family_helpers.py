"""Slapo's per-family helpers (``schedlang.model_schedule.<family>.<helper>``) on tiny configs: outputs and
gradients against the unscheduled model, on one rank and (where they shard) on two gloo ranks; and
``gen_embedding_hooks`` on two ranks."""

import pytest
import torch
from torch import nn

import schedlang as slapo
from schedlang.errors import ScheduleValueError
from schedlang.model_schedule import albert, bert, gpt2, gpt_neo, opt, t5
from schedlang.pipeline import generate_pipeline_partition
from tests.helpers.distributed import run_distributed
from tests.slapo.test_model_schedule import _tiny


def _gpt2_no_dropout():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=96, attn_pdrop=0.0,
                        resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg), cfg


def test_gpt2_replacements_keep_outputs_and_gradients():
    model, cfg = _gpt2_no_dropout()
    ids = torch.randint(0, 96, (2, 7))
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs={"input_ids": ids}):
        counts = gpt2.replace_modules(sch["transformer"], cfg, {"attn_op_name": "math"})
        assert gpt2.checkpoint(sch["transformer"], cfg, ckpt_ratio=0.5) == 1
    assert counts == {"attention layers with math op": 2, "MLP layers": 2}
    built, _ = slapo.build(sch, init_weights=False)
    # the replaced modules' gradients, mapped back to the original layout
    for m in (model, built):
        m.train()
        m(ids).logits.pow(2).mean().backward()
    layer, ref = built.transformer.h[1], model.transformer.h[1]
    torch.testing.assert_close(layer.mlp.fc_in.weight.grad, ref.mlp.c_fc.weight.grad.t(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(layer.attn.module.out_proj.weight.grad, ref.attn.c_proj.weight.grad.t(),
                               atol=1e-5, rtol=1e-4)
    # q, k, v of head 0 are the first rows of the per-head fused projection
    d = 32 // 4
    torch.testing.assert_close(layer.attn.module.qkv.weight.grad[:d], ref.attn.c_attn.weight.grad.t()[:d],
                               atol=1e-5, rtol=1e-4)


def test_gpt_neo_replacements_and_checkpoint_methods():
    model, kwargs = _tiny("gpt_neo")
    cfg = model.config
    cfg.attention_dropout = cfg.resid_dropout = cfg.embed_dropout = 0.0
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs=kwargs):
        counts = gpt_neo.replace_attention_and_mlp(sch["transformer"], cfg, {"attn_op_name": "math"})
    assert counts == {"attention layers with math op": 1, "MLP layers": 2}  # the local-attention layer stays
    assert type(sch["transformer.h.1.attn.attention"].mod).__name__ == "GPTNeoSelfAttention"
    assert gpt_neo.checkpoint(sch["transformer"], cfg, ckpt_ratio=0.5, checkpoint_method="head") == 1
    with pytest.raises(ScheduleValueError, match=r"^transformer: unknown checkpoint_method 'every'; valid are "
                                                 r"uniform, head$"):
        gpt_neo.checkpoint(sch["transformer"], cfg, checkpoint_method="every")


def test_bert_and_albert_fusion_and_checkpoint_on_one_rank():
    for family, module, base in (("bert", bert, "bert"), ("albert", albert, "albert")):
        model, kwargs = _tiny(family)
        sch = slapo.create_schedule(model)
        with slapo.Verify(sch, example_kwargs=kwargs):
            assert module.fuse_bias_gelu(sch[base], model.config) == (2 if family == "bert" else 1)
            assert module.checkpoint(sch[base], model.config, ckpt_ratio=1.0) >= 1
        # nothing to shard on one rank
        assert module.shard_mlp(sch[base], model.config) == 0


def test_pipeline_schedules_split_like_the_model():
    model, cfg = _gpt2_no_dropout()
    model.eval()
    sch = slapo.create_schedule(model)
    assert gpt2.generate_pipeline_schedule(sch, {"pipeline_cuts": [0], "prefix": "transformer"}) == \
        ["transformer.h.0"]
    parts = generate_pipeline_partition(sch)
    ids = torch.randint(0, 96, (2, 7))
    torch.testing.assert_close(parts.mod(ids).logits, model(ids).logits)
    with pytest.raises(ScheduleValueError, match=r"pipeline_cuts \[5\] are not layer indices of 'transformer\.h'"):
        gpt2.generate_pipeline_schedule(slapo.create_schedule(model), {"pipeline_cuts": [5], "prefix": "transformer"})

    t5_model, kwargs = _tiny("t5")
    t5_model.eval()
    sch = slapo.create_schedule(t5_model)
    assert t5.generate_pipeline_schedule(sch, {"pipeline_cuts": [[0], [0]]}) == \
        ["encoder.block.0", "encoder.block.1", "decoder.block.0"]
    assert t5.checkpoint(sch, t5_model.config, ckpt_ratio=0.5) == 2
    assert "ckpt_ratio" in gpt2.get_sch_config_str({"ckpt_ratio": 0.5, "model_config": cfg})


def _sharded_helpers(rank, world):
    out = {}
    torch.manual_seed(0)
    model, cfg = _gpt2_no_dropout()
    ids = torch.randint(0, 96, (2, 7))
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs={"input_ids": ids}):
        gpt2.replace_modules(sch["transformer"], cfg, {"attn_op_name": "math"})
        out["gpt2"] = gpt2.shard_parameters(sch["transformer"], sch["lm_head"], cfg, ["embed", "attention", "mlp"])
    out["gpt2_annotated"] = gpt2.annotate_layernorm_and_bias(sch)

    model, kwargs = _tiny("opt")
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs=kwargs):
        base = sch["model"]
        out["opt"] = (opt.replace_and_shard_attention(base, model.config)[0],
                      opt.replace_and_shard_mlp(base, model.config, disable_fuse_bias_gelu=False))
        opt.shard_word_embedding(base, sch["lm_head"], model.config.vocab_size)

    for family, module in (("bert", bert), ("albert", albert)):
        model, kwargs = _tiny(family)
        sch = slapo.create_schedule(model)
        with slapo.Verify(sch, example_kwargs=kwargs):
            base = sch[family]
            out[family] = (module.replace_and_shard_attention(base, model.config)[0],
                           module.shard_mlp(base, model.config))
            module.shard_word_embedding(base, model.config.vocab_size)

    model, kwargs = _tiny("t5")
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs=kwargs):
        out["t5"] = (t5.replace_and_shard_attention(sch, model.config, {}), t5.fix_position_bias_shape(sch),
                     t5.shard_mlp(sch, model.config, "encoder.block.N.layer.1.DenseReluDense"))
        t5.shard_word_embedding(sch, model.config.vocab_size)

    # broadcast_input: every rank computes on rank 0's ids
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Embedding(96, 4))   # the same weights on every rank
    sch = slapo.create_schedule(lin)
    gpt2.broadcast_input(sch)
    built, _ = slapo.build(sch, init_weights=False)
    mine = torch.randint(0, 96, (3,), generator=torch.Generator().manual_seed(rank + 1))  # different ids per rank
    result = built(mine)
    out["broadcast"] = result.tolist()
    out["own_ids_used"] = torch.equal(result, built[0].weight[mine])
    return out


@pytest.mark.slow
def test_family_helpers_shard_on_two_ranks():
    results = run_distributed(_sharded_helpers, world_size=2, timeout=600)
    first = results[0]
    assert first["gpt2"] == ["Shard input embedding and output embedding", "Shard 2 attention layers",
                             "Shard 2 MLP layers"]
    assert first["gpt2_annotated"] > 0
    assert first["opt"] == (2, 2) and first["bert"] == (2, 2) and first["albert"] == (1, 1)
    assert first["t5"] == (6, 0, 2)   # 2 encoder + 2x2 decoder attentions; bias tables already split
    assert results[0]["broadcast"] == results[1]["broadcast"]   # rank 1 ran on rank 0's ids
    assert results[0]["own_ids_used"] and not results[1]["own_ids_used"]


def _embedding_hooks(rank, world):
    from schedlang.model_schedule.gpt2 import gen_embedding_hooks

    torch.manual_seed(0)
    vocab = 38  # 19 rows per rank
    model = nn.Sequential(nn.Embedding(vocab, 5))
    ids = torch.randint(0, vocab, (3, 11))
    sch = slapo.create_schedule(model)
    sch["0"].shard("weight", axis=0)
    pre, post = gen_embedding_hooks(sch["0"], vocab)
    sch["0"].sync(mode="fwd_pre", sync_op_or_fn=pre)
    sch["0"].sync(mode="fwd_post", sync_op_or_fn=post)
    built, _ = slapo.build(sch, init_weights=False)
    local = built[0]

    def plain(t):
        return t.to_local() if hasattr(t, "to_local") else t

    weight = plain(local.weight)
    rows = weight.shape[0]
    start = local.vocab_start_index
    # the ids fall in both ranks' rows: the sum equals the whole lookup only if each rank contributes
    # zeros for the ids outside its rows
    outside = (ids < start) | (ids >= start + rows)
    masked_elsewhere = bool(outside.any()) and not bool(outside.all())
    out = built(ids)
    ref = model(ids)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(plain(out), ref)
    torch.testing.assert_close(plain(local.weight.grad), model[0].weight.grad[start:start + rows])
    try:
        built(torch.tensor([[vocab]]))
        bad = None
    except ScheduleValueError as e:
        bad = str(e)
    return rows, masked_elsewhere, bad


@pytest.mark.slow
def test_gen_embedding_hooks_on_two_ranks_match_the_whole_embedding():
    results = run_distributed(_embedding_hooks, world_size=2, timeout=300)
    assert [r[0] for r in results] == [19, 19]
    assert all(r[1] for r in results)
    assert results[0][2] == "0: embedding ids must lie in [0, 38), got values in [38, 38]"

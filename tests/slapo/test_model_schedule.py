"""Ready-made schedules per family (tiny configs): Verify passes at world 1 and on 2 gloo ranks, with
checkpointing and fusion; head counts follow the shards."""

import pytest
import torch

import schedlang as slapo
from schedlang.model_schedule import apply_schedule, get_schedule
from tests.helpers.distributed import run_distributed


def _tiny(family):
    """(model, example kwargs) for a tiny random model of ``family``."""
    import transformers as tf

    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 7))
    common = dict(vocab_size=96)
    if family == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, **common))
    elif family == "gpt_neo":
        model = tf.GPTNeoForCausalLM(tf.GPTNeoConfig(
            num_layers=2, hidden_size=32, num_heads=4, max_position_embeddings=16,
            attention_types=[[["global", "local"], 1]], window_size=4, **common))
    elif family == "opt":
        model = tf.OPTForCausalLM(tf.OPTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                               ffn_dim=64, max_position_embeddings=16, word_embed_proj_dim=32,
                                               **common))
    elif family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                   num_key_value_heads=2, intermediate_size=48,
                                                   max_position_embeddings=16, **common))
    elif family in ("bert", "roberta"):
        cfg_cls, model_cls = (tf.BertConfig, tf.BertForMaskedLM) if family == "bert" else \
            (tf.RobertaConfig, tf.RobertaForMaskedLM)
        model = model_cls(cfg_cls(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=20, **common))
        ids = ids.clamp(min=3)
    elif family == "albert":
        model = tf.AlbertForMaskedLM(tf.AlbertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                     intermediate_size=64, embedding_size=16,
                                                     max_position_embeddings=16, **common))
    elif family == "t5":
        model = tf.T5ForConditionalGeneration(tf.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=48,
                                                          num_heads=4, d_kv=8, relative_attention_num_buckets=8,
                                                          decoder_start_token_id=0, **common))
        return model, {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    else:
        raise KeyError(family)
    model.config.hidden_dropout_prob = getattr(model.config, "hidden_dropout_prob", 0.0)
    return model, {"input_ids": ids}


FAMILIES = ["gpt2", "gpt_neo", "opt", "llama", "bert", "roberta", "albert", "t5"]
# GPT-Neo's checkpointed blocks re-append to the KV cache when Verify backpropagates through every
# output (the cache included); its checkpointing is checked by training instead, below
CKPT = {"gpt_neo": 0.0}


def _schedule_and_verify(family, **options):
    model, kwargs = _tiny(family)
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs=kwargs):
        apply_schedule(sch, family, **options)
    return sch


@pytest.mark.parametrize("family", FAMILIES)
def test_family_schedule_verifies_on_one_rank_with_checkpointing_and_fusion(family):
    sch = _schedule_and_verify(family, ckpt_ratio=CKPT.get(family, 0.5), fuse=True)
    steps = [s.primitive for s in sch.plan]
    assert steps.count("checkpoint") == {"t5": 2, "gpt_neo": 0}.get(family, 1)   # half the layers (T5: of 4 blocks)
    if family in ("bert", "roberta", "albert", "gpt_neo", "opt"):
        assert "replace" in steps     # bias + activation fused
        assert any(type(m).__name__ == "LinearWithAct" for m in sch.mod.modules())


def _two_ranks(rank, world, families):
    out = {}
    for family in families:
        sch = _schedule_and_verify(family, ckpt_ratio=CKPT.get(family, 0.5), fuse=family != "opt")
        out[family] = sorted({s.primitive for s in sch.plan})
    # head counts follow the shards where HF reads them in forward
    sch = slapo.create_schedule(_tiny("opt")[0])
    apply_schedule(sch, "opt")
    out["opt_heads"] = sch["model.decoder.layers.0.self_attn"].mod.num_heads
    sch = slapo.create_schedule(_tiny("t5")[0])
    apply_schedule(sch, "t5")
    attn = sch["decoder.block.0.layer.1.EncDecAttention"].mod
    out["t5_heads"] = (attn.n_heads, attn.inner_dim)
    return out


@pytest.mark.slow
def test_every_family_verifies_tensor_parallel_on_two_ranks():
    results = run_distributed(_two_ranks, world_size=2, args=(FAMILIES,), timeout=600)
    for family in FAMILIES:
        assert {"shard", "sync"} | ({"checkpoint"} if CKPT.get(family, 0.5) else set()) <= set(results[0][family])
    assert results[0]["opt_heads"] == 2 and results[1]["t5_heads"] == (2, 16)


def test_unknown_schedule_and_options_are_named():
    with pytest.raises(KeyError, match="no model schedule named 'gptj': valid are albert, bert, gpt2, gpt_neo"):
        get_schedule("gptj")
    with pytest.raises(TypeError, match=r"apply_schedule\('opt'\): unknown options \['ckpt'\]"):
        apply_schedule(torch.nn.Linear(2, 2), "opt", ckpt=0.5)
    with pytest.raises(ValueError, match=r"ckpt_ratio must be a number in \[0, 1\], got 2"):
        apply_schedule(torch.nn.Linear(2, 2), "opt", ckpt_ratio=2)


def test_gpt_neo_checkpointed_layers_train_like_the_original():
    model, kwargs = _tiny("gpt_neo")
    sch = apply_schedule(model, "gpt_neo", ckpt_ratio=1.0, fuse=True)
    built, _ = slapo.build(sch)
    grads = []
    for m in (model, built):
        m.train()
        torch.manual_seed(1)
        m(**kwargs, use_cache=False).logits.float().pow(2).mean().backward()
        grads.append(m.get_input_embeddings().weight.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)

"""ALBERT: its layers share weights (``albert_layer_groups.*.albert_layers.*`` run
``num_hidden_layers`` times), so each shared layer is sharded once: q, k, v column parallel and
the attention's ``dense`` row parallel; ``ffn`` column and ``ffn_output`` row parallel; bias +
activation of ``ffn`` fused with ``fuse=True``. The word embeddings and the tied MLM decoder are
vocabulary parallel (logits gathered unless ``gather_logits=False``)."""

from __future__ import annotations

from . import _helpers
from ._base import finish, prepare, schedule_layers
from ._helpers import broadcast_input, fix_attention_mask_shape
from .registry import register_schedule

__all__ = ["apply", "generate_pipeline_schedule", "fix_attention_mask_shape", "replace_and_shard_attention",
           "shard_word_embedding", "fuse_bias_gelu", "shard_mlp", "checkpoint", "broadcast_input", "shared_layers"]


def shared_layers(sch):
    base = sch["albert"] if "albert" in sch.child else sch
    groups = base["encoder.albert_layer_groups"]
    return [layer for group in groups.child.values() for layer in group["albert_layers"].child.values()]


@register_schedule()
def apply(model, **sch_config):
    sch = prepare(model, sch_config, "albert")
    layers = shared_layers(sch)
    with sch.atomic():
        schedule_layers(sch, layers, sch_config, attention=("attention", ["query", "key", "value"], "dense"),
                        mlp=("", ["ffn"], "ffn_output"), fuse=("", "ffn", "activation"))
        if sch.world_size > 1:
            base = sch["albert"] if "albert" in sch.child else sch
            _helpers.shard_vocabulary(sch, f"{base.path}.embeddings.word_embeddings" if base.path else
                                      "embeddings.word_embeddings", "predictions.decoder", sch_config)
    return finish(sch, "albert", layers, sch_config)


# Slapo's helpers. ``sch`` is the schedule of the base model (``sch["albert"]``) unless said otherwise.


def replace_and_shard_attention(sch, model_config, attn_path="encoder.albert_layer_groups.N.albert_layers.N",
                                delay_init=True, attn_op_name="cuda"):
    """Tensor-parallel attention at every ``attn_path``: query, key, value column parallel, the output
    projection row parallel; the HF attention stays (it runs the SDPA kernel) and its head count
    follows the shard. Returns ``(count, attn_op_name)``."""
    return _helpers.shard_attention(sch, f"{attn_path}.attention", ["query", "key", "value"], "dense"), attn_op_name


def shard_word_embedding(sch, vocab_size, word_embed_name="embeddings.word_embeddings"):
    """Vocabulary-parallel word embedding (see :func:`schedlang.model_schedule.gpt2.gen_embedding_hooks`)."""
    _helpers.shard_word_embedding(sch, vocab_size, word_embed_name)


def fuse_bias_gelu(sch, model_config, path="encoder.albert_layer_groups.N.albert_layers.N"):
    """Fuse the bias add and GELU of ``ffn`` in every module at ``path``; returns the count."""
    return _helpers.fuse_bias_gelu(sch, path, "ffn", "activation")


def shard_mlp(sch, model_config, path="encoder.albert_layer_groups.N.albert_layers.N", fc_names=("ffn", "ffn_output")):
    """``fc_names[0]`` column and ``fc_names[1]`` row parallel at every ``path``; returns the count."""
    return _helpers.shard_mlp(sch, path, fc_names)


def checkpoint(sch, model_config, path="encoder.albert_layer_groups.N.albert_layers.N", ckpt_ratio=1.0, checkpoint_method="uniform"):
    """Checkpoint ``ckpt_ratio`` of the layers at ``path``; returns how many."""
    return _helpers.checkpoint(sch, path, ckpt_ratio, checkpoint_method)


def generate_pipeline_schedule(sch, sch_config):
    """``sch`` is the whole model's: trace down to the layers under ``prefix``, cut after ``pipeline_cuts``."""
    return _helpers.generate_pipeline_schedule(sch, sch_config, "encoder.albert_layer_groups.N.albert_layers.N")

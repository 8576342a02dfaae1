"""BERT (``BertForMaskedLM`` / ``BertModel``): bias + GELU of the intermediate projection fused
(``fuse=True``), :func:`schedlang.models.shard_bert` (heads, MLP, vocabulary-parallel embeddings
and decoder) and checkpointing."""

from __future__ import annotations

from . import _helpers
from ._base import finish, fuse_bias_act, prepare
from ._helpers import broadcast_input, fix_attention_mask_shape
from .registry import register_schedule

__all__ = ["apply", "generate_pipeline_schedule", "fix_attention_mask_shape", "replace_and_shard_attention",
           "shard_word_embedding", "fuse_bias_gelu", "shard_mlp", "checkpoint", "broadcast_input", "encoder_layers"]


def encoder_layers(sch):
    """The schedules of the encoder layers of a BERT-like model (``encoder.layer``)."""
    frontier = [sch]
    for _ in range(3):
        for s in frontier:
            if "encoder" in s.child and "layer" in s["encoder"].child:
                return list(s["encoder.layer"].child.values())
        frontier = [c for s in frontier for c in s.child.values()]
    raise ValueError(f"{sch.path or '<root>'}: {type(sch.mod).__name__} has no encoder.layer list")


@register_schedule()
def apply(model, **sch_config):
    from ..models import shard_bert

    sch = prepare(model, sch_config, "bert")
    layers = encoder_layers(sch)
    if sch_config.get("fuse", False):
        for layer in layers:
            fuse_bias_act(layer["intermediate"], "dense", "intermediate_act_fn")
    if sch.world_size > 1:
        shard_bert(sch, sequence_parallel=sch_config.get("sequence_parallel", False),
                   gather_logits=sch_config.get("gather_logits", True))
    return finish(sch, "bert", layers, sch_config)


# Slapo's helpers. ``sch`` is the schedule of the base model (``sch["bert"]``) unless said otherwise.


def replace_and_shard_attention(sch, model_config, attn_path="encoder.layer.N.attention", delay_init=True, attn_op_name="cuda"):
    """Tensor-parallel attention at every ``attn_path``: query, key, value column parallel, the output
    projection row parallel; the HF attention stays (it runs the SDPA kernel) and its head count
    follows the shard. Returns ``(count, attn_op_name)``."""
    return _helpers.shard_attention(sch, attn_path, ["self.query", "self.key", "self.value"], "output.dense"), attn_op_name


def shard_word_embedding(sch, vocab_size, word_embed_name="embeddings.word_embeddings"):
    """Vocabulary-parallel word embedding (see :func:`schedlang.model_schedule.gpt2.gen_embedding_hooks`)."""
    _helpers.shard_word_embedding(sch, vocab_size, word_embed_name)


def fuse_bias_gelu(sch, model_config, path="encoder.layer.N.intermediate"):
    """Fuse the bias add and GELU of ``dense`` in every module at ``path``; returns the count."""
    return _helpers.fuse_bias_gelu(sch, path, "dense", "intermediate_act_fn")


def shard_mlp(sch, model_config, path="encoder.layer.N", fc_names=("intermediate", "output")):
    """``fc_names[0]`` column and ``fc_names[1]`` row parallel at every ``path``; returns the count."""
    return _helpers.shard_mlp(sch, path, fc_names)


def checkpoint(sch, model_config, path="encoder.layer.N", ckpt_ratio=1.0, checkpoint_method="uniform"):
    """Checkpoint ``ckpt_ratio`` of the layers at ``path``; returns how many."""
    return _helpers.checkpoint(sch, path, ckpt_ratio, checkpoint_method)


def generate_pipeline_schedule(sch, sch_config):
    """``sch`` is the whole model's: trace down to the layers under ``prefix``, cut after ``pipeline_cuts``."""
    return _helpers.generate_pipeline_schedule(sch, sch_config, "encoder.layer.N")

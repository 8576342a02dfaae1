"""OPT: per decoder layer, ``self_attn.{q,k,v}_proj`` column parallel and ``out_proj`` row parallel
(the head count follows the shard, through the generic attention rule), ``fc1`` column and ``fc2`` row parallel, bias + activation of
``fc1`` fused with ``fuse=True``. The token embeddings and the tied LM head are vocabulary parallel
(logits gathered unless ``gather_logits=False``); position embeddings stay whole."""

from __future__ import annotations

from . import _helpers
from ._base import finish, prepare
from ._helpers import broadcast_input, fix_attention_mask_shape
from .registry import register_schedule

__all__ = ["apply", "generate_pipeline_schedule", "fix_attention_mask_shape", "replace_and_shard_attention",
           "shard_word_embedding", "replace_and_shard_mlp", "checkpoint", "broadcast_input"]

@register_schedule()
def apply(model, **sch_config):
    sch = prepare(model, sch_config, "opt")
    layers = _helpers.schedule_decoder(sch, sch_config, "model", "decoder.layers", "decoder.embed_tokens",
                                       attention=("self_attn", ["q_proj", "k_proj", "v_proj"], "out_proj"),
                                       mlp=("", ["fc1"], "fc2"), fuse=("", "fc1", "activation_fn"))
    return finish(sch, "opt", layers, sch_config)


# Slapo's helpers. ``sch`` is the schedule of the base model (``sch["model"]``) unless said otherwise.


def replace_and_shard_attention(sch, model_config, attn_path="decoder.layers.N.self_attn", delay_init=True,
                                attn_op_name="cuda"):
    """Tensor-parallel attention at every ``attn_path``: ``q/k/v_proj`` column, ``out_proj`` row parallel;
    the HF attention stays (it already runs the SDPA kernel) and its head count follows the shard.
    Returns ``(count, attn_op_name)``."""
    return _helpers.shard_attention(sch, attn_path, ["q_proj", "k_proj", "v_proj"], "out_proj"), attn_op_name


def shard_word_embedding(sch, head_sch, vocab_size, word_embed_name="decoder.embed_tokens"):
    """Vocabulary-parallel ``word_embed_name`` and LM head ``head_sch`` (logits gathered)."""
    _helpers.shard_word_embedding(sch, vocab_size, word_embed_name, head_sch)


def replace_and_shard_mlp(sch, model_config, path="decoder.layers.N", fc_names=("fc1", "fc2"), delay_init=True,
                          disable_fuse_bias_gelu=True):
    """``fc_names[0]`` column and ``fc_names[1]`` row parallel at every ``path``; unless
    ``disable_fuse_bias_gelu``, the first's bias and activation fused first. Returns the count."""
    with sch.atomic():
        if not disable_fuse_bias_gelu:
            _helpers.fuse_bias_gelu(sch, path, fc_names[0], "activation_fn")
        return _helpers.shard_mlp(sch, path, fc_names)


def checkpoint(sch, model_config, path="decoder.layers.N", ckpt_ratio=1.0, checkpoint_method="uniform"):
    """Checkpoint ``ckpt_ratio`` of the layers at ``path``; returns how many."""
    return _helpers.checkpoint(sch, path, ckpt_ratio, checkpoint_method)


def generate_pipeline_schedule(sch, sch_config):
    """``sch`` is the whole model's: trace to ``<prefix>.decoder.layers``, cut after ``pipeline_cuts``."""
    return _helpers.generate_pipeline_schedule(sch, sch_config, "decoder.layers.N")

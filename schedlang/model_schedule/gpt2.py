"""GPT-2 (``GPT2LMHeadModel`` / ``GPT2Model``): :func:`schedlang.models.shard_gpt2` (heads of the
fused ``c_attn``, the MLP, vocabulary-parallel embeddings and LM head) plus checkpointing.
GPT-2's projections are HF ``Conv1D``s, so there is no Linear to fuse the bias with."""

from __future__ import annotations

from ..errors import ScheduleValueError
from . import _helpers
from ._base import delegate
from ._helpers import (annotate_layernorm_and_bias, broadcast_input, fix_attention_mask_shape,  # noqa: F401
                       gen_embedding_hooks, get_sch_config_str)
from .registry import register_schedule

__all__ = ["apply", "gen_embedding_hooks", "get_sch_config_str", "replace_modules", "replace_attention", "replace_mlp",
           "fix_attention_mask_shape", "shard_parameters", "annotate_layernorm_and_bias", "checkpoint",
           "broadcast_input", "generate_pipeline_schedule"]


@register_schedule()
def apply(model, **sch_config):
    from ..models import shard_gpt2

    return delegate(model, sch_config, "gpt2", shard_gpt2, "transformer", "h")


# Slapo's helpers. ``sch`` is the schedule of the base model (``sch["transformer"]``) unless said otherwise.


def replace_attention(sch, model_config, attn_path="h.N.attn", delay_init=True, attn_op_name="cuda"):
    """Replace every ``GPT2Attention`` at ``attn_path`` by a fused-qkv :class:`~schedlang.op.FlashAttention`
    (wrapped in the HF call signature) holding the same weights; ``attn_op_name`` picks the SDPA
    kernel. Returns ``(count, attn_op_name)``. ``delay_init`` is accepted for Slapo's signature (the
    weights are carried over, so there is nothing to initialize)."""

    def make(attn):
        heads = model_config.num_attention_heads
        (qw, kw, vw), (qb, kb, vb) = attn.c_attn.weight.t().chunk(3, dim=0), attn.c_attn.bias.chunk(3)
        return _helpers.flash_attention_from((qw, qb), (kw, kb), (vw, vb),
                                             (attn.c_proj.weight.t(), attn.c_proj.bias), heads,
                                             model_config.attn_pdrop, model_config.resid_pdrop, attn_op_name)

    return _helpers.replace_each(sch, attn_path, make), attn_op_name


def replace_mlp(sch, model_config, path="h.N.mlp", delay_init=True):
    """Replace every ``GPT2MLP`` at ``path`` by a :class:`~schedlang.op.FusedMLP` (``fc_in`` with the bias
    and activation fused, ``fc_out`` with the dropout) holding the same weights. Returns the count."""
    return _helpers.replace_each(sch, path, lambda mlp: _helpers.fused_mlp_from(
        (mlp.c_fc.weight.t(), mlp.c_fc.bias), (mlp.c_proj.weight.t(), mlp.c_proj.bias),
        model_config.activation_function, model_config.resid_pdrop))


def replace_modules(sch, model_config, sch_config):
    """:func:`replace_attention` and :func:`replace_mlp` on every layer; returns ``{what: count}``."""
    attn_op = sch_config.get("attn_op_name", "cuda")
    count, op = replace_attention(sch, model_config, attn_op_name=attn_op)
    return {f"attention layers with {op} op": count, "MLP layers": replace_mlp(sch, model_config)}


def shard_parameters(sch, head_sch, model_config, shard_target, sequence_parallel=False, layer_path="h.N",
                     attn="attn", mlp="mlp", word_embed="wte"):
    """Tensor parallelism over modules replaced by :func:`replace_modules`: ``shard_target`` lists what
    to shard: ``"embed"`` (vocabulary-parallel ``wte`` and ``head_sch``, the LM head, with gathered
    logits), ``"attention"`` (``module.qkv`` column, ``module.out_proj`` row parallel), ``"mlp"``
    (``fc_in`` column, ``fc_out`` row parallel). Returns what was done, one line each."""
    if sequence_parallel:
        raise ScheduleValueError(f"{sch.path or '<root>'}: shard_parameters(sequence_parallel=True) is not supported; "
                                 "use schedlang.models.shard_gpt2(sch, sequence_parallel=True) on the HF modules")
    log = []
    if sch.world_size == 1:
        return log
    with sch.atomic():
        if "embed" in shard_target:
            _helpers.shard_word_embedding(sch, model_config.vocab_size, word_embed, head_sch)
            log.append("Shard input embedding" + (" and output embedding" if head_sch is not None else ""))
        if "attention" in shard_target:
            n = _helpers.shard_attention(sch, f"{layer_path}.{attn}.module", ["qkv"], "out_proj")
            log.append(f"Shard {n} attention layers")
        if "mlp" in shard_target:
            n = _helpers.shard_mlp(sch, f"{layer_path}.{mlp}", ["fc_in", "fc_out"])
            log.append(f"Shard {n} MLP layers")
    return log


def checkpoint(sch, model_config, path="h.N", ckpt_ratio=1.0, checkpoint_method="uniform"):
    """Checkpoint ``ckpt_ratio`` of the layers at ``path`` (``"uniform"``: spread, ``"head"``: the first
    ones); returns how many."""
    return _helpers.checkpoint(sch, path, ckpt_ratio, checkpoint_method)


def generate_pipeline_schedule(sch, sch_config):
    """``sch`` is the whole model's schedule: trace it down to ``<prefix>.h`` and end a stage after each
    layer index in ``sch_config["pipeline_cuts"]``; returns the cut paths."""
    return _helpers.generate_pipeline_schedule(sch, sch_config, "h.N")

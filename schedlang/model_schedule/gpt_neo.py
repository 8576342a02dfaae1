"""GPT-Neo: per layer, ``attn.attention.{q,k,v}_proj`` column parallel and ``out_proj`` row parallel
(the attention's head count follows the shard), ``mlp.c_fc`` column and ``mlp.c_proj`` row
parallel, bias + activation of ``c_fc`` fused with ``fuse=True``. The word embeddings ``wte`` and the
tied LM head are vocabulary parallel (logits gathered unless ``gather_logits=False``)."""

from __future__ import annotations

from . import _helpers
from ._base import finish, prepare, register_head_count_rule
from ._helpers import annotate_layernorm_and_bias
from .registry import register_schedule

__all__ = ["apply", "replace_attention_and_mlp", "replace_attention", "replace_mlp", "shard_parameters",
           "annotate_layernorm_and_bias", "checkpoint"]

register_head_count_rule("GPTNeoSelfAttention", "q_proj", "num_heads", "head_dim")


@register_schedule()
def apply(model, **sch_config):
    sch = prepare(model, sch_config, "gpt_neo")
    layers = _helpers.schedule_decoder(sch, sch_config, "transformer", "h", "wte",
                                       attention=("attn.attention", ["q_proj", "k_proj", "v_proj"], "out_proj"),
                                       mlp=("mlp", ["c_fc"], "c_proj"), fuse=("mlp", "c_fc", "act"))
    return finish(sch, "gpt_neo", layers, sch_config)


# Slapo's helpers. ``sch`` is the schedule of the base model (``sch["transformer"]``).


def replace_attention(sch, model_config, attn_path="h.N.attn.attention", delay_init=True, attn_op_name="cuda"):
    """Replace every ``GPTNeoSelfAttention`` at ``attn_path`` by a fused-qkv
    :class:`~schedlang.op.FlashAttention` holding the same weights (GPT-Neo does not scale its
    scores, so neither does the kernel). Only the global-attention layers: a local layer applies its
    sliding window inside the HF module, so it stays. Returns ``(count, attn_op_name)``."""

    def make(attn):
        return _helpers.flash_attention_from(
            (attn.q_proj.weight, None), (attn.k_proj.weight, None), (attn.v_proj.weight, None),
            (attn.out_proj.weight, attn.out_proj.bias), model_config.num_heads,
            model_config.attention_dropout, model_config.resid_dropout, attn_op_name, scale=1.0)

    count = _helpers.replace_each(sch, attn_path, make, keep=lambda m: getattr(m, "attention_type", "global") == "global")
    return count, attn_op_name


def replace_mlp(sch, model_config, path="h.N.mlp", delay_init=True):
    """Replace every ``GPTNeoMLP`` at ``path`` by a :class:`~schedlang.op.FusedMLP` holding the same
    weights; returns the count."""
    return _helpers.replace_each(sch, path, lambda mlp: _helpers.fused_mlp_from(
        (mlp.c_fc.weight, mlp.c_fc.bias), (mlp.c_proj.weight, mlp.c_proj.bias), model_config.activation_function,
        model_config.resid_dropout))


def replace_attention_and_mlp(sch, model_config, sch_config):
    """:func:`replace_attention` (kernel ``sch_config["attn_op_name"]``) and :func:`replace_mlp`;
    returns ``{what: count}``."""
    count, op = replace_attention(sch, model_config, attn_op_name=sch_config.get("attn_op_name", "cuda"))
    return {f"attention layers with {op} op": count, "MLP layers": replace_mlp(sch, model_config)}


def shard_parameters(sch, head_sch, model_config, shard_target, sequence_parallel=False):
    """Tensor parallelism over modules replaced by :func:`replace_attention_and_mlp` (see
    :func:`schedlang.model_schedule.gpt2.shard_parameters`)."""
    from .gpt2 import shard_parameters as shard_replaced

    return shard_replaced(sch, head_sch, model_config, shard_target, sequence_parallel=sequence_parallel,
                          attn="attn.attention")


def checkpoint(sch, model_config, path="h.N", ckpt_ratio=1.0, checkpoint_method="uniform"):
    """Checkpoint ``ckpt_ratio`` of the layers at ``path``; returns how many."""
    return _helpers.checkpoint(sch, path, ckpt_ratio, checkpoint_method)

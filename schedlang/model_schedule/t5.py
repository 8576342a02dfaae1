"""T5: in every block of the encoder and the decoder, each attention (``SelfAttention``, and the
decoder's ``EncDecAttention``) has q, k, v column parallel and ``o`` row parallel, and the
relative position bias table (one column per head) is split with the heads; the feed-forward
``wi`` (or the gated ``wi_0``, ``wi_1``) is column and ``wo`` row parallel. The attention's head
count (``n_heads``, ``inner_dim``) follows the shard. The shared embeddings and the LM head are
vocabulary parallel (logits gathered unless ``gather_logits=False``); T5's projections have no bias,
so there is nothing to fuse."""

from __future__ import annotations

from . import _helpers
from ..errors import ScheduleValueError
from ..module_record import shard_specs
from ._base import finish, prepare, register_head_count_rule, shard_block
from ._helpers import broadcast_input
from .registry import register_schedule

__all__ = ["apply", "replace_and_shard_attention", "checkpoint", "generate_pipeline_schedule", "fix_position_bias_shape",
           "shard_word_embedding", "shard_mlp", "broadcast_input"]

register_head_count_rule("T5Attention", "q", "n_heads", "key_value_proj_dim", width_attrs=("inner_dim",))


def _shard_attention(attn) -> None:
    shard_block(attn, ["q", "k", "v"], "o")
    if "relative_attention_bias" in attn.child:
        attn["relative_attention_bias"].shard("weight", axis=1)


def _shard_ff(ff) -> None:
    columns = [n for n in ("wi", "wi_0", "wi_1") if n in ff.child]
    shard_block(ff, columns, "wo")


@register_schedule()
def apply(model, **sch_config):
    sch = prepare(model, sch_config, "t5")
    blocks = []
    for stack in ("encoder", "decoder"):
        if stack in sch.child:
            blocks += list(sch[f"{stack}.block"].child.values())
    with sch.atomic():
        if sch.world_size > 1:
            for block in blocks:
                for sub in block["layer"].child.values():
                    for name in ("SelfAttention", "EncDecAttention"):
                        if name in sub.child:
                            _shard_attention(sub[name])
                    if "DenseReluDense" in sub.child:
                        _shard_ff(sub["DenseReluDense"])
            _helpers.shard_vocabulary(sch, "shared", "lm_head", sch_config)
    return finish(sch, "t5", blocks, sch_config)


def _attentions(sch):
    found = []
    for stack in ("encoder", "decoder"):
        if stack in sch.child:
            for block in sch[f"{stack}.block"].child.values():
                for sub in block["layer"].child.values():
                    found += [sub[n] for n in ("SelfAttention", "EncDecAttention") if n in sub.child]
    return found


# Slapo's helpers. ``sch`` is the schedule of the T5 model.


def replace_and_shard_attention(sch, model_config, sch_config):
    """Tensor-parallel attention in every block: q, k, v column and o row parallel, the relative
    position bias split with the heads; the HF attention stays and its head count follows. Returns
    the number of attentions sharded (0 on one rank)."""
    if sch.world_size == 1:
        return 0
    attentions = _attentions(sch)
    with sch.atomic():
        for attn in attentions:
            _shard_attention(attn)
    return len(attentions)


def fix_position_bias_shape(sch, delay_init=True):
    """Split every relative position bias table not split yet with the heads (one column per head);
    returns how many were split. ``replace_and_shard_attention`` already does it."""
    if sch.world_size == 1:
        return 0
    count = 0
    with sch.atomic():
        for attn in _attentions(sch):
            if "relative_attention_bias" in attn.child and \
                    "weight" not in shard_specs(attn["relative_attention_bias"].mod):
                attn["relative_attention_bias"].shard("weight", axis=1)
                count += 1
    return count


def shard_word_embedding(sch, vocab_size, word_embed_name="shared"):
    """Vocabulary-parallel shared embeddings (encoder and decoder read the same table)."""
    _helpers.shard_word_embedding(sch, vocab_size, word_embed_name)


def shard_mlp(sch, model_config, path, fc_names=("wi", "wo")):
    """``fc_names[0]`` column and ``fc_names[1]`` row parallel at every ``path`` (e.g.
    ``"encoder.block.N.layer.1.DenseReluDense"``); returns the count."""
    return _helpers.shard_mlp(sch, path, fc_names)


def checkpoint(sch, model_config, path="", ckpt_ratio=1.0, checkpoint_method="uniform"):
    """Checkpoint ``ckpt_ratio`` of the encoder blocks and of the decoder blocks; returns how many."""
    prefix = f"{path}." if path else ""
    with sch.atomic():
        return sum(_helpers.checkpoint(sch, f"{prefix}{stack}.block.N", ckpt_ratio, checkpoint_method)
                   for stack in ("encoder", "decoder"))


def generate_pipeline_schedule(sch, sch_config):
    """``sch_config["pipeline_cuts"]`` is ``[encoder block cuts, decoder block cuts]``: trace down to the
    blocks, cut after those blocks and between the encoder and the decoder (after the encoder's last
    block). Returns the cut paths."""
    cuts = sch_config.get("pipeline_cuts")
    if not cuts:
        return []
    if not (isinstance(cuts, (list, tuple)) and len(cuts) == 2):
        raise ScheduleValueError(f"{sch.path or '<root>'}: T5's pipeline_cuts must be [encoder block indices, decoder "
                                 f"block indices], got {cuts!r}")
    prefix = sch_config.get("prefix", "")
    p = f"{prefix}." if prefix else ""
    last_encoder = str(len(sch[f"{p}encoder.block"].child) - 1)
    encoder_cuts = sorted({str(c) for c in cuts[0]} | {last_encoder}, key=int)
    sch.trace_until([f"{p}encoder.block", f"{p}decoder.block"])
    paths = [f"{p}encoder.block.{c}" for c in encoder_cuts] + [f"{p}decoder.block.{c}" for c in cuts[1]]
    for path in paths:
        sch[path].cut_pipeline_stage()
    return paths

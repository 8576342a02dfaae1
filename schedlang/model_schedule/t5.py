"""T5: in every block of the encoder and the decoder, each attention (``SelfAttention``, and the
decoder's ``EncDecAttention``) has q, k, v column parallel and ``o`` row parallel, and the
relative position bias table (one column per head) is split with the heads; the feed-forward
``wi`` (or the gated ``wi_0``, ``wi_1``) is column and ``wo`` row parallel. The attention's head
count (``n_heads``, ``inner_dim``) follows the shard. Embeddings stay whole; T5's projections
have no bias, so there is nothing to fuse."""

from __future__ import annotations

from ._base import finish, prepare, register_head_count_rule, shard_block
from .registry import register_schedule

__all__ = ["apply"]

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
    return finish(sch, "t5", blocks, sch_config)

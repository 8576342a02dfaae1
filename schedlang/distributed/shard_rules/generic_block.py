"""The shard rule for attention and MLP modules of any class: it reads the module's ``forward``.

Sharding the projections of an attention module column-wise (q, k, v) and row-wise (the output
projection) is only half of tensor parallelism: the module's forward still reshapes with the
*global* head count (``view(bsz, -1, self.num_heads, self.head_dim)`` in OPT) and computes a
wrong result without complaint. This rule, asked for any module that has projection children and
no rule of its own, keeps such modules consistent:

* **what the forward reads**: the ``self.<attr>`` and ``self.config.<attr>`` names of ``forward``
  (and the helper methods it calls; see :mod:`.forward_code`). Head counts (``num_heads``,
  ``num_attention_heads``, ``num_key_value_heads``, ...) become local counts, attention widths
  (``embed_dim``, ``hidden_size``, ``all_head_size``, ``split_size``, ... when equal to heads x
  head size) local widths; per-head sizes and ratios (``head_dim``, ``num_key_value_groups``) stay.
  Values read through ``self.config`` are changed in a per-module shallow copy of the config (the
  user's model and the other modules keep theirs).
* **shapes**: the projections' widths against the head geometry say which projection is q, k, v,
  a fused q|k|v or k|v, and every rank must get whole heads (key/value heads included: fewer
  key/value heads than ranks is refused, they are not replicated).
* **per-head biases from the caller**: an argument of the forward holding one bias per head (ALiBi's
  ``alibi``, MPT's ``position_bias``) is cut to this rank's heads by a forward pre-hook
  (:mod:`.per_head_bias`).
* **fused layouts**: what forward does first with a fused projection's output says how its parts
  are stored. Reshaped into heads first (GPT-NeoX, Falcon: ``view(..., heads, 3 * head_dim)``):
  head by head, so a contiguous split gives every rank its heads. Split or sliced first (Phi-3's
  ``qkv_proj``, ``gate_up_proj``): part after part, so each part is split (``groups``) and rank r
  gets [q_r, k_r, v_r] or [gate_r, up_r]. With fewer key/value heads than query heads the q, k and v
  parts have unequal widths: the rule asks for blocks of those sizes (``ShardSpec.blocks``), and
  rank r still gets its query heads and the key/value heads they attend with.

Whatever the rule cannot tell (an integer attribute equal to a head count it has no meaning for,
a fused layout it cannot read, per-head submodules) is refused at shard time with a
:class:`~schedlang.errors.ShardError` naming the class, the attributes found, and how to register
a rule for it: never a silently wrong model.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Dict, Optional, Tuple

from torch import nn

from ...errors import ShardError
from ..sharding import remember_unsharded, shard_specs, unsharded_view
from . import ShardRule, register_fallback_rule
from .forward_code import attribute_reads, first_consumer, is_conv1d, is_projection, projection_dataflow
from .per_head_bias import install_head_bias_slices

__all__ = ["GenericBlockShardRule", "HEAD_COUNTS", "KV_HEAD_COUNTS", "HEAD_DIMS", "attention_reads",
           "is_attention"]

logger = logging.getLogger("schedlang.distributed.shard_rules.generic_block")

#: attribute names, by meaning (both ``self.<name>`` and ``self.config.<name>``)
HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_head", "n_attention_heads")
KV_HEAD_COUNTS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv", "num_kv",
                  "multi_query_group_num")
HEAD_RATIOS = ("num_key_value_groups", "num_queries_per_kv", "n_rep", "kv_groups")
HEAD_DIMS = ("head_dim", "head_size", "attention_head_size", "d_head", "kv_channels")
ATTENTION_WIDTHS = ("embed_dim", "hidden_size", "all_head_size", "split_size", "inner_dim", "n_embd", "d_model",
                    "projection_size", "attention_hidden_size", "hidden_dim")
MLP_WIDTHS = ("intermediate_size", "ffn_dim", "ffn_hidden_size", "n_inner", "d_ff", "inner_dim",
              "intermediate_dim")
#: integers a forward may read that sharding never changes
UNCHANGED = HEAD_DIMS + HEAD_RATIOS + (
    "layer_idx", "layer_id", "rotary_ndims", "rotary_dim", "rotary_emb_dim", "max_position_embeddings",
    "sliding_window", "window_size", "vocab_size", "num_hidden_layers", "pad_token_id", "bos_token_id",
    "eos_token_id", "max_seq_len", "block_size", "position_embedding_size", "num_buckets")

HINT = ("register a rule for it: a ShardRule subclass with module_type_names = ({name!r},) whose "
        "check_child_shard / after_child_shard fix the module, decorated with "
        "schedlang.distributed.shard_rules.register_shard_rule (tutorials/07_new_family.py shows one)")


@dataclasses.dataclass(frozen=True)
class Heads:
    """Head geometry of an attention module before sharding."""

    q: int
    kv: int
    dim: int


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def attention_reads(module: nn.Module) -> Optional[Tuple[frozenset, frozenset]]:
    """``(self reads, config reads)`` of ``module``'s forward, or None without source."""
    return attribute_reads(type(module))


def is_attention(module: nn.Module) -> bool:
    """Whether ``module``'s forward reads a head count or a head size: it computes attention over heads."""
    reads = attention_reads(module)
    if reads is None:
        return False
    names = set(HEAD_COUNTS + KV_HEAD_COUNTS + HEAD_DIMS + HEAD_RATIOS)
    return bool((reads[0] | reads[1]) & names)


def _config_value(config, name: str):
    """``config.<name>``, or None where the config has none or refuses to give one globally (a value that
    differs between layers, which transformers reads per layer)."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers raises its own error for per-layer values read globally
        return None


def _original_config(module: nn.Module):
    return unsharded_view(module)[1].get("config", getattr(module, "config", None))


def _original(module: nn.Module, name: str):
    attributes = unsharded_view(module)[1]
    return attributes[name] if name in attributes else module.__dict__.get(name)


def _first(values: Dict[str, object], names) -> Optional[int]:
    for n in names:
        if _int(values.get(n)):
            return values[n]
    return None


def heads_of(module: nn.Module) -> Optional[Heads]:
    """The module's head geometry from its own attributes, else its config's; None if it cannot be told."""
    own = {k: _original(module, k) for k in module.__dict__}
    config = _original_config(module)
    conf = {k: _config_value(config, k) for k in HEAD_COUNTS + KV_HEAD_COUNTS + HEAD_DIMS + ("hidden_size",)} \
        if config is not None else {}
    q = _first(own, HEAD_COUNTS) or _first(conf, HEAD_COUNTS)
    dim = _first(own, HEAD_DIMS) or _first(conf, HEAD_DIMS)
    if dim is None and q:
        width = _first(own, ATTENTION_WIDTHS) or conf.get("hidden_size")
        dim = width // q if _int(width) and width % q == 0 else None
    if q is None and dim:
        width = _first(own, ATTENTION_WIDTHS) or conf.get("hidden_size")
        q = width // dim if _int(width) and width % dim == 0 else None
    if not q or not dim:
        return None
    kv = _first(own, KV_HEAD_COUNTS) or _first(conf, KV_HEAD_COUNTS) or q
    return Heads(q=q, kv=kv, dim=dim)


def _head_size_only(module: nn.Module) -> Optional[int]:
    """The head size of a module that reads a head size but neither a head count nor an attention width
    (its own or its config's); None otherwise."""
    own = {k: _original(module, k) for k in module.__dict__}
    config = _original_config(module)
    conf = {k: _config_value(config, k) for k in HEAD_COUNTS + HEAD_DIMS} if config is not None else {}
    if _first(own, HEAD_COUNTS) or _first(conf, HEAD_COUNTS) or _first(own, ATTENTION_WIDTHS):
        return None
    dim = _first(own, HEAD_DIMS) or _first(conf, HEAD_DIMS)
    return dim if _int(dim) else None


def _direction(child: nn.Module, tensor_name: str, axis: int) -> Optional[str]:
    """"column" (outputs split) or "row" (inputs split) for a projection's tensor, else None."""
    if not is_projection(child):
        return None
    if tensor_name == "bias":
        return "column" if axis == 0 else None
    if tensor_name != "weight":
        return None
    out_axis = 1 if is_conv1d(child) else 0
    return "column" if axis == out_axis else "row"


def _width(child: nn.Module, direction: str) -> int:
    """Full (unsharded) output width of a column projection, or input width of a row projection."""
    spec = shard_specs(child).get("weight")
    shape = spec.full_shape if spec is not None else tuple(child.weight.shape)
    out_axis = 1 if is_conv1d(child) else 0
    return shape[out_axis] if direction == "column" else shape[1 - out_axis]


def _fail(path: str, module: nn.Module, tensor_name: str, why: str, found: Dict[str, object]) -> ShardError:
    name = type(module).__name__
    shown = ", ".join(f"{k}={v}" for k, v in sorted(found.items())) or "none"
    return ShardError(f"{path or '<root>'}: cannot shard '{tensor_name}': {why}; {name}.forward reads {shown}; "
                      + HINT.format(name=name))


def _found(module: nn.Module) -> Dict[str, object]:
    """The integer attributes the module's forward reads (config ones as ``config.<name>``), for messages."""
    reads = attention_reads(module) or (frozenset(), frozenset())
    config = _original_config(module)
    found = {k: _original(module, k) for k in reads[0] if _int(_original(module, k))}
    found.update({f"config.{k}": _config_value(config, k) for k in reads[1] if _int(_config_value(config, k))})
    return found


def _whole(path, module, tensor_name, count: int, world: int, what: str) -> None:
    if count % world:
        valid = ", ".join(str(w) for w in range(1, count + 1) if count % w == 0)
        raise _fail(path, module, tensor_name,
                    f"{what} over {world} ranks: every rank must hold whole heads; valid world sizes: {valid}",
                    _found(module))


def _local_attention_values(path, module, tensor_name, heads: Heads, world: int):
    """``(attribute updates, config updates)`` for the local heads; ShardError for what cannot be told."""
    reads = attention_reads(module) or (frozenset(), frozenset())
    q_width, kv_width = heads.q * heads.dim, heads.kv * heads.dim
    meaningful = {heads.q, heads.kv, q_width, kv_width, (heads.q + 2 * heads.kv) * heads.dim}

    def local(name: str, value) -> Optional[int]:
        if not _int(value):
            return None
        if name in HEAD_COUNTS:
            if value == heads.q:
                return heads.q // world
            if value == heads.kv:
                return heads.kv // world
        elif name in KV_HEAD_COUNTS:
            if value == heads.kv:
                return heads.kv // world
        elif name in UNCHANGED:
            return None
        elif name in ATTENTION_WIDTHS:
            if value == q_width:
                return q_width // world
            if value == kv_width:
                return kv_width // world
            return None  # the model's width, not the attention's: never reshaped with
        elif value <= 1 or value not in meaningful:
            return None
        raise _fail(path, module, tensor_name,
                    f"its forward reads {name}={value}, which matches the head geometry ({heads.q} query heads, "
                    f"{heads.kv} key/value heads of size {heads.dim}) but has no meaning the generic rule knows",
                    _found(module))

    names = set(reads[0]) | {k for k in module.__dict__ if k in HEAD_COUNTS + KV_HEAD_COUNTS}
    own = {}
    for name in sorted(names):
        new = local(name, _original(module, name))
        if new is not None:
            own[name] = new
    config = _original_config(module)
    conf = {}
    for name in sorted(reads[1]):
        new = local(name, _config_value(config, name))
        if new is not None:
            conf[name] = new
    return own, conf


def _check_per_head_children(path, module, tensor_name, heads: Heads) -> None:
    """Submodules holding one entry per head (StableLM's per-head LayerNorms) would need sharding too."""
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and len(sub) > 1 and len(sub) in (heads.q, heads.kv):
            raise _fail(path, module, tensor_name,
                        f"its submodule '{name}' holds one module per head ({len(sub)}), which the generic rule "
                        "does not split", _found(module))


def _apply(module: nn.Module, own: Dict[str, int], conf: Dict[str, int]) -> None:
    remember_unsharded(module, **{k: _original(module, k) for k in own})
    for k, v in own.items():
        module.__dict__[k] = v
    if conf:
        original = _original_config(module)
        remember_unsharded(module, config=original)
        local = copy.copy(original)  # this module's own config: the user's and the other modules' stay
        for k, v in conf.items():
            setattr(local, k, v)
        module.__dict__["config"] = local
    logger.debug("%s: local values %s, config %s", type(module).__name__, own, conf)


class GenericBlockShardRule(ShardRule):
    """Attention and MLP modules without a rule of their own (see the module docstring)."""

    @classmethod
    def applies_to(cls, module: nn.Module) -> bool:
        return any(is_projection(c) for c in module.children()) and attention_reads(module) is not None

    # ------------------------------------------------------------------ attention
    @classmethod
    def _attention_groups(cls, path, module, child_name, child, tensor_name, direction, world):
        heads = heads_of(module)
        width = _width(child, direction)
        if heads is None:
            dim = _head_size_only(module)
            if dim is None:
                raise _fail(path, module, tensor_name, f"the head count and head size of {type(module).__name__} "
                            "cannot be told from its attributes or its config", _found(module))
            # the forward reads only the size of a head (``view(b, s, -1, head_dim)``): the head count follows
            # the tensor's width, so whole heads per rank is all a split needs
            if width % dim:
                raise _fail(path, module, tensor_name, f"its width {width} is not a whole number of heads of "
                            f"size {dim}", _found(module))
            _whole(path, module, tensor_name, width // dim, world, f"the projection has {width // dim} heads")
            return 1
        groups = 1
        if direction == "row":
            if width != heads.q * heads.dim:
                raise _fail(path, module, tensor_name,
                            f"its input width {width} is not {heads.q} heads x {heads.dim}", _found(module))
            _whole(path, module, tensor_name, heads.q, world, f"the output projection's input has {heads.q} heads")
        elif width == heads.q * heads.dim:
            _whole(path, module, tensor_name, heads.q, world, f"the projection has {heads.q} heads")
        elif width == heads.kv * heads.dim:
            if heads.kv < world:
                raise _fail(path, module, tensor_name,
                            f"the key/value projection has {heads.kv} heads, fewer than the {world} ranks; "
                            "key/value heads are not replicated: use at most "
                            f"{heads.kv} ranks or a model with more key/value heads", _found(module))
            _whole(path, module, tensor_name, heads.kv, world, f"the key/value projection has {heads.kv} heads")
        elif width in ((heads.q + 2 * heads.kv) * heads.dim, 2 * heads.kv * heads.dim):
            parts = 3 if width == (heads.q + 2 * heads.kv) * heads.dim else 2
            layout = first_consumer(type(module), child_name)
            what = "q|k|v" if parts == 3 else "k|v"
            if layout == "reshape":  # head by head (per key/value group): a contiguous split keeps groups whole
                _whole(path, module, tensor_name, heads.kv, world,
                       f"the fused {what} projection holds {heads.kv} key/value groups")
            elif layout == "split" and (heads.q == heads.kv or parts == 2):
                _whole(path, module, tensor_name, heads.kv, world, f"each part of the fused {what} projection has "
                                                                   f"{heads.kv} heads")
                groups = parts
            elif layout == "split":
                # q | k | v of unequal widths (fewer key/value heads): each part split on its own, so rank r
                # gets its query heads, and the key/value heads they attend with
                if heads.kv < world:
                    raise _fail(path, module, tensor_name,
                                f"the fused q|k|v projection has {heads.kv} key/value heads, fewer than the {world} "
                                f"ranks; key/value heads are not replicated: use at most {heads.kv} ranks or a model "
                                "with more key/value heads", _found(module))
                _whole(path, module, tensor_name, heads.kv, world,
                       f"the fused q|k|v projection has {heads.kv} key/value heads")
                _whole(path, module, tensor_name, heads.q, world, f"the fused q|k|v projection has {heads.q} heads")
                groups = (heads.q * heads.dim, heads.kv * heads.dim, heads.kv * heads.dim)
            else:
                raise _fail(path, module, tensor_name,
                            f"the layout of the fused {what} projection '{child_name}' cannot be told from the forward "
                            "(neither reshaped into heads nor split into parts first)", _found(module))
        else:
            raise _fail(path, module, tensor_name,
                        f"its output width {width} is none of the head geometry's ({heads.q} query heads, {heads.kv} "
                        f"key/value heads of size {heads.dim})", _found(module))
        _check_per_head_children(path, module, tensor_name, heads)
        _local_attention_values(path, module, tensor_name, heads, world)
        return groups

    # ------------------------------------------------------------------ MLP
    @classmethod
    def _mlp_row(cls, module, child_name) -> Optional[nn.Module]:
        names = [n for n, c in module.named_children() if is_projection(c)]
        flows = projection_dataflow(type(module), names) or {}
        rows = [n for n, sources in flows.items() if child_name in sources]
        return getattr(module, rows[0]) if len(rows) == 1 else None

    @classmethod
    def _mlp_values(cls, path, module, tensor_name, widths) -> Dict[str, int]:
        reads = attention_reads(module) or (frozenset(), frozenset())
        out = {}
        for name in sorted(reads[0]):
            value = _original(module, name)
            if not _int(value) or value <= 1 or value not in widths:
                continue
            if name in MLP_WIDTHS:
                out[name] = value
            elif name not in UNCHANGED + ATTENTION_WIDTHS:
                raise _fail(path, module, tensor_name,
                            f"its forward reads {name}={value}, the width being split, with no meaning the generic "
                            "rule knows", _found(module))
        return out

    @classmethod
    def _mlp_groups(cls, path, module, child_name, child, tensor_name, direction, world) -> Tuple[int, Dict]:
        if direction != "column":
            return 1, {}
        row = cls._mlp_row(module, child_name)
        if row is None:
            return 1, {}
        width, inner = _width(child, "column"), _width(row, "row")
        groups = 1
        if width != inner and width % inner == 0 and width // inner in (2, 3):
            layout = first_consumer(type(module), child_name)
            if layout == "split":
                groups = width // inner  # gate | up stored one after the other: each rank gets its part of both
            elif layout != "reshape":
                raise _fail(path, module, tensor_name,
                            f"'{child_name}' ({width} outputs) feeds a projection of {inner} inputs, so it looks fused, "
                            "but how its parts are laid out cannot be told from the forward", _found(module))
        values = cls._mlp_values(path, module, tensor_name, {width, inner})
        return groups, {k: (v // world) for k, v in values.items()}

    # ------------------------------------------------------------------ hooks
    @classmethod
    def check_child_shard(cls, path, module, child_name, child, tensor_name, axis, world_size):
        """The fused layout of the split: a number of equal blocks, or a tuple of unequal block sizes."""
        direction = _direction(child, tensor_name, axis)
        if direction is None:
            return 1
        if is_attention(module):
            return cls._attention_groups(path, module, child_name, child, tensor_name, direction, world_size)
        return cls._mlp_groups(path, module, child_name, child, tensor_name, direction, world_size)[0]

    @classmethod
    def after_child_shard(cls, module, child_name, child, tensor_name, axis, world_size, rank):
        if _direction(child, tensor_name, axis) != "column":
            return
        if is_attention(module):
            heads = heads_of(module)
            if heads is None:  # only a head size is read: nothing in the module depends on the head count
                return
            own, conf = _local_attention_values("", module, tensor_name, heads, world_size)
            # a per-head bias the caller passes in (ALiBi) must follow the heads this rank keeps
            install_head_bias_slices(module, heads.q, rank, world_size)
        else:
            own, conf = cls._mlp_groups("", module, child_name, child, tensor_name, "column", world_size)[1], {}
        _apply(module, own, conf)


register_fallback_rule(GenericBlockShardRule)

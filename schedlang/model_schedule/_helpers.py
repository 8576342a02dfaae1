"""The per-family helper functions of Slapo's ``slapo.model_schedule.<family>`` modules, written once
over schedlang's primitives; each family module binds them to its own module paths.

Paths are relative to the schedule passed in (Slapo passes the base model, e.g. ``sch["bert"]``)
and may hold ``N`` for "every index": ``"encoder.layer.N.attention"`` names the attention of every
encoder layer (each ``N`` is matched against the schedule tree, so ALBERT's
``"encoder.albert_layer_groups.N.albert_layers.N"`` works too).
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..errors import ScheduleKeyError, ScheduleValueError
from ..logger import get_logger
from ..module_record import shard_specs
from ._base import fuse_bias_act, schedule_layers, shard_column, shard_row

__all__ = ["expand_paths", "get_sch_config_str", "shard_word_embedding", "shard_vocabulary", "shard_attention", "shard_mlp", "checkpoint",
           "fuse_bias_gelu", "broadcast_input", "fix_attention_mask_shape", "annotate_layernorm_and_bias",
           "generate_pipeline_schedule", "CHECKPOINT_METHODS"]

logger = get_logger("schedlang.model_schedule")

CHECKPOINT_METHODS = ("uniform", "head")


def expand_paths(sch, pattern: str) -> List[str]:
    """The paths under ``sch`` that ``pattern`` names, ``N`` standing for every child index, in order."""
    found = [""]
    for part in pattern.split(".") if pattern else ():
        nxt = []
        for prefix in found:
            node = sch[prefix] if prefix else sch
            names = list(node.child) if part == "N" else [part] if part in node.child else []
            nxt.extend(f"{prefix}.{n}" if prefix else n for n in names)
        found = nxt
    if not found:
        raise ScheduleKeyError(f"{sch.path or '<root>'}: no submodule matches '{pattern}' (N stands for every index); "
                               f"valid children here: {', '.join(sch.child) or 'none'}")
    return found


def get_sch_config_str(sch_config: Dict[str, Any]) -> str:
    """``sch_config`` as indented JSON (model configs through their ``to_dict``, other objects by repr)."""

    def encode(obj):
        return obj.to_dict() if hasattr(obj, "to_dict") else repr(obj)

    return json.dumps(sch_config, indent=2, sort_keys=True, default=encode)


def gen_embedding_hooks(sch, vocab_size):
    """The ``(fwd_pre, fwd_post)`` sync functions of a vocabulary-parallel word embedding.

    For ``sch["wte"].shard("weight", axis=0)`` followed by
    ``sync(mode="fwd_pre", sync_op_or_fn=pre)`` and ``sync(mode="fwd_post", sync_op_or_fn=post)``.
    The sharded embedding already looks up only the ids of its own rows and returns zero rows
    for the others (:class:`schedlang.distributed.shard_rules.embedding.VocabParallelEmbedding`),
    so ``pre`` only checks that the ids lie in ``[0, vocab_size)`` and ``post`` sums the partial
    embeddings over ``sch.group``. Written as ``fn(tensor) -> tensor``, the form ``sync`` takes.

    Example::

        sch["transformer.wte"].shard("weight", axis=0)
        pre, post = gen_embedding_hooks(sch, model.config.vocab_size)
        sch["transformer.wte"].sync(mode="fwd_pre", sync_op_or_fn=pre)
        sch["transformer.wte"].sync(mode="fwd_post", sync_op_or_fn=post)
    """
    from ..distributed import collectives

    where = sch.path or "<root>"
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < sch.world_size:
        raise ScheduleValueError(f"{where}: gen_embedding_hooks needs the vocabulary size as an int of at least the "
                                 f"group size {sch.world_size}, got {vocab_size!r}")
    group = sch.group

    def embedding_ids_in_range(ids):
        if not ids.is_floating_point() and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ScheduleValueError(f"{where}: embedding ids must lie in [0, {vocab_size}), got values in "
                                     f"[{int(ids.min())}, {int(ids.max())}]")
        return ids

    def sum_partial_embeddings(output):
        return collectives.reduce_forward(output, group) if sch.world_size > 1 else output

    return embedding_ids_in_range, sum_partial_embeddings


def _sharded(sch, name: str) -> bool:
    return name in shard_specs(sch.mod)


def shard_word_embedding(sch, vocab_size: int, word_embed_name: str, head_sch=None,
                         gather_logits: bool = True) -> None:
    """Vocabulary-parallel word embedding: each rank holds ``vocab_size / world`` rows; ids outside a
    rank's rows look up zeros and the partial embeddings are summed (:func:`gen_embedding_hooks`).
    ``head_sch``, an LM head, and every Linear tied to the embedding's weight are split along the
    vocabulary too: their input gradients are summed and, with ``gather_logits``, their logits are
    gathered. Nothing on one rank."""
    if sch.world_size == 1:
        return
    emb = sch[word_embed_name]
    heads = [head_sch] if head_sch is not None else []
    # a head tied to the embedding is split with it, so it needs its syncs (and its bias split) too
    # and so is another embedding module reading the same table (T5's encoder and decoder embed_tokens)
    root = sch.root
    lookups = [emb]
    for path, module in root.mod.named_modules():
        if getattr(module, "weight", None) is not emb.mod.weight or path == emb.path:
            continue
        if isinstance(module, nn.Linear) and all(h.path != path for h in heads):
            heads.append(root[path])
        elif isinstance(module, nn.Embedding) and module is not emb.mod:
            lookups.append(root[path])
    with sch.atomic():
        if not _sharded(emb, "weight"):
            emb.shard("weight", axis=0)
        for lookup in lookups:
            pre, post = gen_embedding_hooks(lookup, vocab_size)
            lookup.sync(mode="fwd_pre", sync_op_or_fn=pre)
            lookup.sync(mode="fwd_post", sync_op_or_fn=post)
        for head_sch in heads:
            if not _sharded(head_sch, "weight"):
                head_sch.shard("weight", axis=0)
            if getattr(head_sch.mod, "bias", None) is not None and not _sharded(head_sch, "bias"):
                head_sch.shard("bias", axis=0)
            head_sch.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
            if gather_logits:
                head_sch.sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-1, tensor_parallel_output_grad=False)


def schedule_decoder(sch, sch_config, base_name: str, layers_name: str, embed_name: str, **parts) -> list:
    """The common schedule of a decoder-only family: every layer under ``<base>.<layers_name>`` scheduled as
    ``parts`` say (:func:`schedule_layers`), and over several ranks the word embedding at
    ``<base>.<embed_name>`` and ``lm_head`` made vocabulary-parallel; ``<base>`` is the child ``base_name``
    when the schedule is of the LM (a base model schedule is its own base). Returns the layers."""
    base = sch[base_name] if base_name in sch.child else sch
    layers = list(base[layers_name].child.values())
    with sch.atomic():
        schedule_layers(sch, layers, sch_config, **parts)
        if sch.world_size > 1:
            shard_vocabulary(sch, f"{base.path}.{embed_name}" if base.path else embed_name, "lm_head", sch_config)
    return layers


def shard_vocabulary(sch, embed_path: str, head_path: str, sch_config: Dict[str, Any]) -> None:
    """``apply_schedule``'s vocabulary parallelism: the word embedding at ``embed_path`` and, when the
    model has one at ``head_path``, the LM head (logits gathered unless ``gather_logits=False``)."""
    vocab = sch[embed_path].mod.weight.shape[0]
    head = sch[head_path] if head_path and head_path in sch else None
    shard_word_embedding(sch, vocab, embed_path, head, gather_logits=sch_config.get("gather_logits", True))


def shard_attention(sch, attn_path: str, qkv: Sequence[str], out: str) -> int:
    """Megatron attention at every ``attn_path``: the ``qkv`` projections column parallel (whole heads per
    rank; the attention's head count follows), ``out`` row parallel with its output summed and the
    block input's gradient summed. Returns how many attentions were sharded (0 on one rank)."""
    if sch.world_size == 1:
        return 0
    paths = expand_paths(sch, attn_path)
    with sch.atomic():
        for path in paths:
            attn = sch[path]
            for name in qkv:
                shard_column(attn[name])
            shard_row(attn[out])
    return len(paths)


def shard_mlp(sch, path: str, fc_names: Sequence[str]) -> int:
    """Megatron MLP at every ``path``: ``fc_names[0]`` column and ``fc_names[1]`` row parallel. A name may
    be a module holding a ``dense`` Linear (BERT's ``intermediate`` / ``output``). Returns the count."""
    if sch.world_size == 1:
        return 0
    paths = expand_paths(sch, path)

    def linear(owner, name):
        sub = owner[name]
        return sub["dense"] if not isinstance(sub.mod, nn.Linear) and "dense" in sub.child else sub

    with sch.atomic():
        for p in paths:
            owner = sch[p]
            shard_column(linear(owner, fc_names[0]))
            shard_row(linear(owner, fc_names[1]))
    return len(paths)


def checkpoint(sch, path: str, ckpt_ratio: float = 1.0, checkpoint_method: str = "uniform") -> int:
    """Activation checkpointing of the layers at ``path``: ``ckpt_ratio`` of them, the first ones
    (``checkpoint_method="head"``) or spread evenly (``"uniform"``: every ``1 / ckpt_ratio``-th layer).
    Returns how many layers were checkpointed."""
    where = sch.path or "<root>"
    if isinstance(ckpt_ratio, bool) or not isinstance(ckpt_ratio, (int, float)) or not 0.0 <= ckpt_ratio <= 1.0:
        raise ScheduleValueError(f"{where}: ckpt_ratio must be a number in [0, 1], got {ckpt_ratio!r}")
    if checkpoint_method not in CHECKPOINT_METHODS:
        raise ScheduleValueError(f"{where}: unknown checkpoint_method {checkpoint_method!r}; valid are "
                                 f"{', '.join(CHECKPOINT_METHODS)}")
    if ckpt_ratio == 0.0:
        return 0
    layers = expand_paths(sch, path)
    count = int(len(layers) * ckpt_ratio)
    if checkpoint_method == "head":
        chosen = layers[:count]
    else:
        chosen = layers[::max(1, int(1 / ckpt_ratio))]
    with sch.atomic():
        for layer in chosen:
            sch[layer].checkpoint()
    return len(chosen)


def fuse_bias_gelu(sch, path: str, linear: str = "dense", act: str = "intermediate_act_fn") -> int:
    """Fuse the bias add of ``linear`` with the activation ``act`` in every module at ``path`` (one
    :class:`~schedlang.op.LinearWithAct`). Returns how many were fused."""
    paths = expand_paths(sch, path)
    done = 0
    with sch.atomic():
        for p in paths:
            done += bool(fuse_bias_act(sch[p], linear, act))
    return done


def broadcast_input(sch) -> None:
    """Every rank of ``sch.group`` runs on rank 0's input: the model's first tensor input is broadcast
    from the group's first rank before the forward (for runtimes that feed each rank its own batch)."""
    import torch.distributed as dist

    if sch.world_size == 1:
        return
    group = sch.group if sch.group is not None else dist.group.WORLD
    source = dist.get_global_rank(group, 0)

    def broadcast_from_first_rank(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().clone()
        dist.broadcast(out, src=source, group=group)
        return out

    sch.sync(mode="fwd_pre", sync_op_or_fn=broadcast_from_first_rank)


def expand_local_heads(tensor: torch.Tensor, *size_inputs, layout: Sequence[Sequence[Any]], world_size: int):
    """``tensor.expand(B, H / world_size, ...)``: the sizes are rebuilt from ``layout`` (per size,
    ``("input", k)``: the ``k``-th traced size value in ``size_inputs``, or ``("const", n)``), and the
    head dimension (the second) is split over the ranks."""
    sizes = [size_inputs[value] if kind == "input" else value for kind, value in layout]
    sizes[1] = sizes[1] // world_size
    return tensor.expand(*sizes).contiguous()


def _expand_sizes(node) -> Optional[List[Any]]:
    """The size arguments of a traced ``x.expand(B, H, S, S)`` (or ``x.expand((B, H, S, S))``), when four."""
    sizes = list(node.args[1:])
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = list(sizes[0])
    return sizes if len(sizes) == 4 and not node.kwargs else None


def _size_layout(node, sizes: List[Any]) -> List[Tuple[str, Any]]:
    """Where each size comes from when the replacement is called with the node's inputs (as ``replace``
    passes them: each distinct input node once, in order of first use), the tensor first."""
    from torch import fx

    inputs: List[Any] = []

    def visit(arg):
        if arg not in inputs:
            inputs.append(arg)
        return arg

    fx.node.map_arg((node.args, node.kwargs), visit)
    # expand_local_heads takes the tensor first, then the other inputs
    return [("input", inputs.index(size) - 1) if isinstance(size, fx.Node) else ("const", size) for size in sizes]


def fix_attention_mask_shape(sch) -> int:
    """In a traced attention, make every ``mask.expand(B, H, S, S)`` expand to this rank's ``H / world``
    heads (an attention kernel that takes the mask per head would otherwise see all heads). Traces the
    module first if needed. Returns how many expands were changed (none on one rank).

    The mask is taken to be data (a padding or causal mask): its gradient, if it had one, would be
    this rank's heads' part only."""
    if sch.world_size == 1:
        return 0
    found = sch.find_node(lambda n: n.op == "call_method" and n.target == "expand" and _expand_sizes(n) is not None)
    with sch.atomic():
        for path, node in found:
            layout = _size_layout(node, _expand_sizes(node))
            kind, heads = layout[1]
            if kind == "const" and (not isinstance(heads, int) or heads % sch.world_size):
                raise ScheduleValueError(f"{sch.path or '<root>'}: fix_attention_mask_shape: '{node.name}' expands "
                                         f"to {heads!r} heads, which do not split over {sch.world_size} ranks; valid "
                                         f"head counts are multiples of {sch.world_size}")
            sch.replace(expand_local_heads, target_ops=[(path, node)],
                        concrete_args={"layout": layout, "world_size": sch.world_size})
    return len(found)


def annotate_layernorm_and_bias(sch) -> int:
    """Mark the parameters that every rank holds whole and that need their gradients summed under
    sequence parallelism: LayerNorm weights and biases, and the bias of every row-parallel Linear
    (``replicated_param=True``). Returns how many parameters were marked."""
    marked = 0
    with sch.atomic():
        for _, sub in sch.named_schedules():
            mod = sub.mod
            names: Iterable[str] = ()
            if isinstance(mod, nn.LayerNorm):
                names = [n for n, _ in mod.named_parameters(recurse=False)]
            elif isinstance(mod, nn.Linear) and mod.bias is not None and \
                    getattr(shard_specs(mod).get("weight"), "axis", None) == 1:
                names = ["bias"]
            for name in names:
                sub.annotate(name, "replicated_param", True)
                marked += 1
    return marked


def generate_pipeline_schedule(sch, sch_config: Dict[str, Any], layer_path: str) -> List[str]:
    """Trace the model down to its layers (``prefix`` in ``sch_config``, then ``layer_path``'s parent) and
    end a pipeline stage after each layer index in ``sch_config["pipeline_cuts"]``. Returns the cut paths."""
    cuts = sch_config.get("pipeline_cuts") or []
    prefix = sch_config.get("prefix", "")
    where = sch.path or "<root>"
    if not cuts:
        return []
    base = f"{prefix}.{layer_path}" if prefix else layer_path
    container = base.rpartition(".")[0]
    layers = sch[container]
    bad = [c for c in cuts if str(c) not in layers.child]
    if bad:
        raise ScheduleValueError(f"{where}: pipeline_cuts {bad} are not layer indices of '{container}'; valid are "
                                 f"0 .. {len(layers.child) - 1}")
    sch.trace_until(container)
    paths = [f"{container}.{c}" for c in cuts]
    for path in paths:
        sch[path].cut_pipeline_stage()
    return paths


# ---------------------------------------------------------------------------------------------- replacements
class SelfAttention(nn.Module):
    """A transformers self-attention's call signature around :class:`~schedlang.op.FlashAttention`
    (``self.module``): ``forward(hidden_states, attention_mask=..., **ignored)`` returns
    ``(output, None)``. A training graph: the KV cache and head masks are not used."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, hidden_states, *args, attention_mask=None, **kwargs):
        out, _ = self.module(hidden_states, attention_mask=attention_mask)
        return out, None


def _per_head_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows ``[q | k | v]`` (each ``(H, ...)``) reordered head by head (``q_h, k_h, v_h``), FlashAttention's layout."""
    stacked = torch.stack([q, k, v])  # (3, H, ...)
    trailing = stacked.shape[2:]  # (in_features,) for a weight, () for a bias
    per_head = stacked.reshape(3, heads, -1, *trailing).transpose(0, 1)
    return per_head.reshape(-1, *trailing).contiguous()


def flash_attention_from(q, k, v, out, heads: int, attn_pdrop: float, resid_pdrop: float, attn_op_name: str,
                         scale: Any = None) -> SelfAttention:
    """A :class:`SelfAttention` computing what the projections ``q``, ``k``, ``v``, ``out`` (``(weight,
    bias)`` pairs in Linear layout, bias may be None) compute, with fresh parameters holding their values."""
    from ..op import FlashAttention

    hidden = q[0].shape[1]
    with torch.device("meta"):
        flash = FlashAttention(hidden, heads, attn_pdrop=attn_pdrop, resid_pdrop=resid_pdrop, attn_op_name=attn_op_name,
                               bias=True, output_proj=True, fused_qkv=True, causal=True)
    flash.qkv.weight = nn.Parameter(_per_head_qkv(q[0], k[0], v[0], heads).detach().clone())
    if q[1] is None:
        flash.qkv.register_parameter("bias", None)
    else:
        flash.qkv.bias = nn.Parameter(_per_head_qkv(q[1], k[1], v[1], heads).detach().clone())
    flash.out_proj.weight = nn.Parameter(out[0].detach().clone())
    if out[1] is None:
        flash.out_proj.register_parameter("bias", None)
    else:
        flash.out_proj.bias = nn.Parameter(out[1].detach().clone())
    if scale is not None:
        flash.attn_op.scale = scale
    return SelfAttention(flash)


def fused_mlp_from(fc_in, fc_out, act: str, resid_pdrop: float) -> nn.Module:
    """A :class:`~schedlang.op.FusedMLP` holding copies of ``fc_in`` / ``fc_out`` (``(weight, bias)`` in
    Linear layout)."""
    from ..op import FusedMLP

    inter, hidden = fc_in[0].shape
    with torch.device("meta"):
        mlp = FusedMLP(hidden, inter, act, resid_pdrop)
    for lin, (weight, bias) in ((mlp.fc_in, fc_in), (mlp.fc_out, fc_out)):
        lin.weight = nn.Parameter(weight.detach().clone())
        lin.bias = nn.Parameter(bias.detach().clone())
    return mlp


def replace_each(sch, path: str, make, keep=None) -> int:
    """``sch[p].replace(make(sch[p].mod))`` for every path ``path`` names (for which ``keep(module)`` is
    true, when given), all or nothing; returns the count."""
    paths = [p for p in expand_paths(sch, path) if keep is None or keep(sch[p].mod)]
    with sch.atomic():
        for p in paths:
            sch[p].replace(make(sch[p].mod))
    return len(paths)

"""The training plan of a schedule, for the report: the layout its plan writes (tensor-parallel shards,
fully_shard / replicate, pipeline cuts, checkpointed layers) estimated by the autotune cost model
(:mod:`schedlang.autotune.training_cost`) as ``schedlang train --dry-run`` prints it: memory per rank, the
collectives of a step with their bytes, the step time. Only decoder-only transformers (a HF config and a
list of decoder layers) get one."""

from __future__ import annotations

from typing import Any, Dict, Optional

from torch import nn


def _mesh_size(mesh, name: str) -> int:
    try:
        return mesh[name].size() if mesh is not None and name in (mesh.mesh_dim_names or ()) else 1
    except Exception:  # a mesh without that dimension
        return 1


def training_plan(sch, global_batch: Optional[int] = None, seq: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """``{"text": block, "estimate": dict}`` for ``sch``'s model, or None when it is no decoder-only transformer.
    ``global_batch`` defaults to one sequence per data-parallel rank, ``seq`` to the model's positions (at most
    2048)."""
    import torch

    from ..autotune.training_cost import Hardware, Layout, ModelShape, estimate_step, format_estimate
    from ..models.auto import _layer_list

    model: nn.Module = sch._state.original
    config = getattr(model, "config", None)
    found = _layer_list(model) if config is not None else None
    if found is None or not hasattr(model, "get_input_embeddings"):
        return None

    def first(*names):
        return next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None)

    hidden, heads = first("hidden_size", "n_embd"), first("num_attention_heads", "n_head")
    vocab = first("vocab_size")
    if not (hidden and heads and vocab):
        return None
    layers = len(found[1])
    params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = out is not None and out.weight is emb
    embedding = emb.numel() + (0 if out is None or tied else out.weight.numel())
    lookups = sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding)
                  for p in m.parameters(recurse=False))
    shape = ModelShape(layers=layers, hidden=hidden, heads=heads,
                       kv_heads=first("num_key_value_heads", "num_kv_heads") or heads,
                       head_dim=first("head_dim") or hidden // heads,
                       intermediate=first("intermediate_size", "ffn_dim", "n_inner") or 4 * hidden, vocab=vocab,
                       params=params, flops_params=params - lookups + (emb.numel() if tied else 0),
                       embedding_params=embedding, tied=tied)
    steps = list(sch.plan)
    mesh = sch.mesh
    tp = _mesh_size(mesh, "tp") if mesh is not None else (sch.world_size if any(s.primitive == "shard" for s in steps)
                                                          else 1)
    dp = _mesh_size(mesh, "dp")
    pp = len([s for s in steps if s.primitive == "cut_pipeline_stage"]) + 1
    fsdp = [s for s in steps if s.primitive == "fully_shard"]
    ddp = [s for s in steps if s.primitive == "replicate"]
    reshard = all(s.args.get("reshard_after_forward") is not False for s in fsdp)

    def policy(step) -> str:
        return str(step.args.get("mp_policy") or "")

    bf16 = any("bfloat16" in policy(s) or "bf16" in policy(s) for s in fsdp + ddp)
    reduce_bf16 = any("reduce_dtype" in policy(s) and "bfloat16" in policy(s).split("reduce_dtype", 1)[1]
                      for s in fsdp + ddp)
    checkpointed = len([s for s in steps if s.primitive == "checkpoint"])
    layout = Layout(pp=pp, dp=dp, tp=tp, dp_mode="ddp" if ddp and not fsdp else "fsdp", reshard=reshard,
                    reduce_dtype="bf16" if reduce_bf16 else "fp32", activation_checkpoint=checkpointed >= layers,
                    sp=any(s.primitive == "sync" and "reduce_scatter" in s.describe() for s in steps),
                    microbatches=pp if pp > 1 else 1, dtype="bf16" if bf16 else "fp32",
                    optimize="optimize" in sch.metadata)
    positions = first("max_position_embeddings", "n_positions") or 2048
    seq = seq or min(positions, 2048)
    global_batch = global_batch or max(1, dp * layout.microbatches)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hw = Hardware.nominal(device, torch.cuda.get_device_name() if device == "cuda" else "", world=pp * dp * tp)
    estimate = estimate_step(shape, layout, hw, global_batch, seq)
    header = (f"{type(model).__name__}: {params / 1e6:,.1f}M parameters, {layers} layers; global batch "
              f"{global_batch} x {seq} tokens, {pp * dp * tp} rank(s) (estimated, as schedlang train --dry-run)")
    return {"text": format_estimate(estimate, hw, header=header), "estimate": estimate.as_dict()}

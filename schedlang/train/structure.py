"""What the trainer reads off a model's structure, whatever its family: the decoder-layer list (the
largest ``nn.ModuleList`` of same-class blocks holding projections), where pipeline stages end,
tied weights, the parameters a train step spends flops on, and whether tensor parallelism can
split it."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from torch import nn

from .flags import _fail


def decoder_layers(model: nn.Module, where: str = "--config") -> Tuple[str, nn.ModuleList]:
    """``(path, layers)`` of the model's decoder blocks, found from its structure (not its family's names)."""
    from ..models.auto import _layer_list

    found = _layer_list(model)
    if found is None:
        _fail(f"{where}: {type(model).__name__} holds no list of decoder layers (an nn.ModuleList of same-class "
              "blocks with Linear projections), so schedlang train cannot split it into layers; give the config of a "
              "decoder-only transformer (e.g. llama, qwen3, mistral, gemma, phi3, opt, gpt2)")
    return found


def layer_paths(model: nn.Module) -> List[str]:
    path, layers = decoder_layers(model)
    return [f"{path}.{i}" for i in range(len(layers))]


def tied_names(model: nn.Module) -> Dict[str, str]:
    """``{name: first name}`` for every name of a parameter the model holds under several names (tied weights)."""
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n: group[0] for group in names.values() if len(group) > 1 for n in group}


def is_tied(model: nn.Module) -> bool:
    out = model.get_output_embeddings()
    return out is not None and out.weight is model.get_input_embeddings().weight


def flops_params(model: nn.Module) -> int:
    """Parameters that cost 6 flops per token in a train step: all but the embedding tables (token and position
    lookups); a token embedding tied to the output head counts once, as the head."""
    seen, total, lookups = set(), 0, 0
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            if isinstance(m, nn.Embedding):
                lookups += p.numel()
    if is_tied(model):
        lookups -= model.get_input_embeddings().weight.numel()
    return total - lookups


def embedding_params(model: nn.Module) -> int:
    """Parameters of the token embedding and the output head (counted once when tied): they sit on the first and
    the last pipeline stage."""
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    return emb.numel() + (0 if out is None or out.weight is emb else out.weight.numel())


def stage_cuts(layers: int, stages: int) -> List[int]:
    """Indices of the layers after which a stage ends: ``stages`` near-equal runs of layers."""
    bounds = [round(layers * (i + 1) / stages) for i in range(stages - 1)]
    return [b - 1 for b in bounds]


def tensor_parallel_problem(model: nn.Module) -> Optional[str]:
    """Why ``shard_model`` cannot split this model (None: it can), found on the meta model before any weight
    exists: a registered family's schedule, or the automatic plan from the model's code."""
    import schedlang
    from ..errors import SchedlangError
    from ..models import FAMILIES, plan_tensor_parallel

    name = type(model).__name__
    if any(name.startswith(prefix) for prefix in FAMILIES):
        return None
    try:
        plan_tensor_parallel(schedlang.create_schedule(model))
    except SchedlangError as e:
        return str(e)
    return None

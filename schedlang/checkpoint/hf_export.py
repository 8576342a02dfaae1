"""``export_hf``: a built model (any layout) written as a HuggingFace directory that
``from_pretrained`` reads: the full tensors gathered on rank 0, config.json and safetensors."""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from typing import Dict, Optional

import torch
from torch import nn

from ..distributed.dtensor_params import _to_dtensor, rank_major_specs
from .ranks import _NAMES_SHOWN, _agree, _all_gather, _dist, _names, _rank
from .experts import expert_view_of, expert_views, relay_expert_entry
from .state import _is_dtensor, _model_state, _stages, full_tensor, plain_shard_mesh, plain_shard_specs

logger = logging.getLogger("schedlang.checkpoint")


def _config_of(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        for stage in _stages(model):
            config = getattr(stage, "config", None)
            if config is not None:
                break
    return config


def _full_state_on_rank0(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The unsharded state dict, on the CPU of rank 0 (empty elsewhere). Collective.

    Each name is gathered by the ranks holding it (``full_tensor`` over its mesh) and kept by the
    lowest of them; pipeline ranks then send what they kept to rank 0. A plain local shard (a schedule
    built without a mesh) is gathered as the DTensor its record describes, over the group it was split on.
    """
    local = _model_state(model)
    rank_major = rank_major_specs(_stages(model))  # tensors laid out rank-major: put back in their order
    plain = plain_shard_specs(model, local)
    experts = expert_views(_stages(model))  # expert-parallel slices: gathered over their expert mesh
    mesh, problem = None, None
    if plain:
        device_type = next(local[k].device.type for k in plain)
        mesh, problem = plain_shard_mesh(model, plain, device_type, "export_hf")
    _agree(problem)
    names = [k for k, v in local.items() if isinstance(v, torch.Tensor)]
    owner: Dict[str, int] = {}
    for r, keys in enumerate(_all_gather(names)):
        for k in keys:
            owner.setdefault(k, r)
    me = _rank()
    kept: Dict[str, torch.Tensor] = {}
    for key in names:  # the same order on every rank holding the same stage (same module structure)
        value = local[key]
        if key in plain:
            value = _to_dtensor(value, plain[key], mesh, is_param=False)
        view = expert_view_of(key, value, experts)
        if view is not None:
            value = relay_expert_entry(value, view)
        if _is_dtensor(value):
            value = full_tensor(value, rank_major.get(key))  # every rank of the tensor's mesh takes part
        if owner[key] == me:
            kept[key] = value.detach().to("cpu", copy=True) if value.device.type != "cpu" else value.detach()
    if any(r != 0 for r in owner.values()):
        dist = _dist()
        parts: Optional[list] = [None] * dist.get_world_size() if me == 0 else None
        dist.gather_object(kept if me != 0 else {}, parts, dst=0)
        if me == 0:
            for part in parts[1:]:
                kept.update(part)
    if me != 0:
        return {}
    order = {k: i for i, k in enumerate(owner)}
    return dict(sorted(kept.items(), key=lambda kv: order[kv[0]]))


def _tied_pairs(model: nn.Module, config) -> Dict[str, str]:
    """HF's ``{tied name: source name}`` for the model's class (transformers 5.x ``_tied_weights_keys``)."""
    tied = getattr(model, "_tied_weights_keys", None)
    if tied is None:
        try:
            from transformers import AutoModelForCausalLM

            cls = AutoModelForCausalLM._model_mapping[type(config)]
            tied = getattr(cls, "_tied_weights_keys", None)
        except Exception:
            tied = None
    return dict(tied) if isinstance(tied, dict) else {}


def _hf_class(model: nn.Module, config):
    """The transformers class ``from_pretrained`` will build: the model's own, else the causal LM of ``config``."""
    model = getattr(model, "_orig_mod", model)
    try:
        from transformers import AutoModelForCausalLM, PreTrainedModel
    except ImportError:
        return None
    if isinstance(model, PreTrainedModel):
        return type(model)
    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except Exception:
        return None


def _check_against_hf(model: nn.Module, config, state: Dict[str, torch.Tensor], tie) -> Optional[str]:
    """Compare the names and shapes to export with those the HF class expects (built on the meta device).

    A name HF expects but does not find would be initialized at random by ``from_pretrained``: refuse
    that (a schedule that renamed parameters, e.g. a replaced module, needs its names mapped back).
    """
    if isinstance(config, dict):
        return None
    cls = _hf_class(model, config)
    if cls is None:
        return None
    try:
        with torch.device("meta"):
            reference = cls(copy.deepcopy(config))
    except Exception as e:  # a config the class cannot take: nothing to compare with
        logger.debug("export_hf: cannot build %s on the meta device (%s); names not checked", cls.__name__, e)
        return None
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    if tie:
        for target in _tied_pairs(reference, config):
            expected.pop(target, None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k!r}: model {tuple(state[k].shape)}, {cls.__name__} {expected[k]}" for k in expected
              if k in state and tuple(state[k].shape) != expected[k]]
    if unexpected:
        logger.warning("export_hf: %s has no tensor named %s; from_pretrained will ignore them", cls.__name__,
                       _names(unexpected))
    if not missing and not shapes:
        return None
    lines = []
    if missing:
        lines.append(f"{len(missing)} tensor(s) that {cls.__name__} expects are not in the model: {_names(missing)}")
    if shapes:
        lines.append("shape mismatch for " + "; ".join(shapes[:_NAMES_SHOWN]))
    return f"export_hf: the model does not fit {cls.__name__}; nothing written:\n  " + "\n  ".join(lines)


def _hf_class_name(model: nn.Module) -> Optional[str]:
    """The transformers class of ``model`` (for ``architectures``), seen through a torch.compile wrapper."""
    model = getattr(model, "_orig_mod", model)
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return type(model).__name__ if isinstance(model, PreTrainedModel) else None


def _write_config(config, directory: str, dtype, tie: Optional[bool], architecture: Optional[str]) -> None:
    if isinstance(config, dict):
        data = dict(config)
        if tie is not None:
            data["tie_word_embeddings"] = tie
        if architecture and not data.get("architectures"):
            data["architectures"] = [architecture]
        data.setdefault("dtype", str(dtype).replace("torch.", "") if dtype is not None else None)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        return
    config = copy.deepcopy(config)
    if tie is not None:
        config.tie_word_embeddings = tie
    if architecture and not getattr(config, "architectures", None):
        config.architectures = [architecture]
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(directory)


def export_hf(model: nn.Module, dir, config=None, dtype: Optional[torch.dtype] = None) -> str:
    """Write ``model``'s unsharded weights as ``dir/model.safetensors`` plus ``dir/config.json``.

    ``transformers.AutoModelForCausalLM.from_pretrained(dir)`` then loads the trained model. All
    ranks must call it (the shards are gathered); only rank 0 writes. ``config`` (a transformers
    config or a dict) defaults to ``model.config``. Tied weights are written as HF expects: with
    ``tie_word_embeddings`` the tied copy (``lm_head.weight``) is left out; if training untied them
    (the two differ) both are written and the exported config says ``tie_word_embeddings=False``.
    ``dtype`` casts floating-point weights (default: as trained). Returns ``dir``.

    Example::

        schedlang.export_hf(model, "out/llama-finetuned")
        hf = transformers.AutoModelForCausalLM.from_pretrained("out/llama-finetuned")
    """
    started = time.perf_counter()
    directory = os.fspath(dir)
    config = config if config is not None else _config_of(model)
    problem = None
    if config is None:
        problem = (f"export_hf: {type(model).__name__} has no .config; pass config= (a transformers config such "
                   f"as LlamaConfig, or a dict) so that config.json can be written")
    else:
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            problem = "export_hf: needs the safetensors package (pip install 'schedlang[hf]')"
    _agree(problem)

    state = _full_state_on_rank0(model)
    problem = None
    if _rank() == 0:
        from safetensors.torch import save_file

        tie = None
        cfg_tie = config.get("tie_word_embeddings") if isinstance(config, dict) else getattr(
            config, "tie_word_embeddings", None)
        pairs = _tied_pairs(model, config) if not isinstance(config, dict) else {}
        for target, source in pairs.items():
            if target not in state or source not in state:
                continue
            same = state[target] is state[source] or (state[target].shape == state[source].shape
                                                      and torch.equal(state[target], state[source]))
            if cfg_tie and same:
                del state[target]  # HF ties it back to the source at load
            elif cfg_tie:
                logger.warning("export_hf: %r and %r differ although tie_word_embeddings is set; both are written "
                               "and the exported config unties them", target, source)
                tie = False
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        problem = _check_against_hf(model, config, state, tie if tie is not None else cfg_tie)
        if problem is not None:
            state = {}
        # safetensors refuses tensors sharing memory and wants them contiguous
        seen, out = set(), {}
        for key, value in state.items():
            ptr = value.untyped_storage().data_ptr() if value.numel() else None
            if ptr is not None and ptr in seen:
                value = value.clone()
            elif ptr is not None:
                seen.add(ptr)
            out[key] = value.contiguous()
        floats = [v.dtype for v in out.values() if v.is_floating_point()]
        weight_dtype = max(set(floats), key=floats.count) if floats else None
        if problem is None:
            os.makedirs(directory, exist_ok=True)
            save_file(out, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
            _write_config(config, directory, weight_dtype, tie, _hf_class_name(model))
            logger.info("exported %d tensors to %s in %.2f s", len(out), directory, time.perf_counter() - started)
    # every rank returns once the files exist, or raises rank 0's error
    _agree(problem if _rank() == 0 else None)
    return directory

"""Distributed checkpoints that load under another layout, and export to a HuggingFace directory.

A checkpoint is a directory written by ``torch.distributed.checkpoint`` (DCP): every rank writes
the shards it holds and a ``.metadata`` file records the global shape of every tensor and which
chunk lies where. Loading reads, on every rank, exactly the chunks its own shards cover, so a
checkpoint saved under one layout (tensor parallel, FSDP2, both, pipeline stages, one process)
loads under any other. The optimizer state is kept per parameter *name*
(``torch.distributed.checkpoint.state_dict`` with a flattened optimizer state dict), so AdamW's
``exp_avg`` / ``exp_avg_sq`` / ``step`` reshard with the weights.

Layout of a checkpoint (keys in ``.metadata``)::

    model.<parameter or buffer name>             the model's state dict (original names)
    optim.state.<parameter name>.<state name>    e.g. optim.state.fc1.weight.exp_avg
    optim.param_groups.<parameter name>.<hyperparameter>
    schedlang                                    step, extra and a format version (pickled)

Example::

    model, opt = schedlang.build(sch, optimizer="adamw")          # any layout
    ...
    schedlang.save_checkpoint("ckpt/step-100", model, opt, step=100, extra={"seed": 0})
    # later, maybe on another number of ranks or another layout
    info = schedlang.load_checkpoint("ckpt/step-100", model, opt)  # {"step": 100, "extra": {...}}
    schedlang.export_hf(model, "hf-out")                          # from_pretrained("hf-out") works
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .errors import CheckpointError

__all__ = ["save_checkpoint", "load_checkpoint", "export_hf", "full_tensor"]

logger = logging.getLogger("schedlang.checkpoint")

#: version of the ``schedlang`` record inside a checkpoint
FORMAT_VERSION = 1
_MODEL, _OPTIM, _META = "model", "optim", "schedlang"
_STATE, _GROUPS = "state.", "param_groups."
#: keys named in an error before "... and N more"
_NAMES_SHOWN = 8


# ------------------------------------------------------------------------------------------------ ranks
def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def _world() -> int:
    dist = _dist()
    return dist.get_world_size() if dist is not None else 1


def _all_gather(obj) -> list:
    """Every rank's ``obj``, by rank (a list of one without torch.distributed)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _agree(problem: Optional[str]) -> None:
    """Raise the same :class:`CheckpointError` on every rank if any rank found a problem.

    A rank that raised alone would leave the others waiting in the next collective.
    """
    found = [(r, p) for r, p in enumerate(_all_gather(problem)) if p]
    if not found:
        return
    messages = list(dict.fromkeys(p for _, p in found))
    if len(messages) == 1:
        raise CheckpointError(messages[0])
    raise CheckpointError("\n".join(f"rank {r}: {p}" for r, p in found))


def _names(keys) -> str:
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:_NAMES_SHOWN])
    return shown + (f" ... and {len(keys) - _NAMES_SHOWN} more" if len(keys) > _NAMES_SHOWN else "")


# ------------------------------------------------------------------------------------------------ model parts
def _stages(model: nn.Module) -> List[nn.Module]:
    """The modules whose state this rank holds: a pipeline's stage modules, else the model itself.

    Pipeline stage modules keep the original model's names (no prefix), so the union of their
    state dicts over all ranks is the original model's state dict.
    """
    stages = getattr(model, "stage_modules", None)
    if stages is None:
        return [model]
    return list(stages)


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def _model_state(model: nn.Module, stage_keys: Optional[list] = None) -> Dict[str, Any]:
    """The union of the stage modules' sharded state dicts (DTensors stay DTensors).

    ``stage_keys``, if given, receives each stage module's names.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    out: Dict[str, Any] = {}
    for stage in _stages(model):
        own = get_model_state_dict(stage)
        if stage_keys is not None:
            stage_keys.append(list(own))
        for key, value in own.items():
            if key in out and out[key] is not value:
                logger.warning("two stage modules on rank %d hold %r; the first one's is used", _rank(), key)
                continue
            out[key] = value
    return out


class _OptimView:
    """The optimizer state dict of a model's stage modules, under the original parameter names.

    ``get_optimizer_state_dict`` names each parameter by its path in the module it is given; for a
    pipeline with several stage modules on one rank that module is a ``ModuleList`` of them, whose
    paths start with the stage index; ``fetch`` drops it and ``store`` puts it back.
    """

    def __init__(self, model: nn.Module):
        stages = _stages(model)
        self.single = len(stages) == 1
        self.module = stages[0] if self.single else nn.ModuleList(stages)
        self._prefixed: Dict[str, str] = {}

    def _strip_key(self, key: str) -> str:
        for head in (_STATE, _GROUPS):
            if key.startswith(head):
                _, _, rest = key[len(head):].partition(".")  # drop the stage index
                return head + rest
        return key

    def fetch(self, optimizer) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        raw = get_optimizer_state_dict(self.module, optimizer, options=_options(flatten_optimizer_state_dict=True))
        if self.single:
            return dict(raw)
        out = {}
        for key, value in raw.items():
            short = self._strip_key(key)
            self._prefixed[short] = key
            out[short] = value
        return out

    def store(self, optimizer, state: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if not self.single:
            state = {self._prefixed.get(k, k): v for k, v in state.items()}
        set_optimizer_state_dict(self.module, optimizer, state, options=_options(flatten_optimizer_state_dict=True))


def _optimizer_is_empty(optimizer) -> bool:
    return optimizer is not None and not optimizer.state


def _reset_optimizer(optimizer) -> None:
    """Forget the state ``get_optimizer_state_dict`` created on an optimizer that had none.

    torch initializes missing state with one zero-learning-rate step, which leaves ``step`` at 1:
    a later real step would then use the bias correction of step 2. Dropping the state again
    leaves the optimizer exactly as it was (the parameters are unchanged by an lr=0 step).
    """
    optimizer.state.clear()
    for key in ("_schedlang_plans", "_schedlang_chunk_tables"):  # schedlang's fused optimizers cache them
        optimizer.__dict__.pop(key, None)


def _zero_step(value):
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else type(value)(0)


# ------------------------------------------------------------------------------------------------ strided shards
def _strided(t) -> bool:
    """A DTensor on a 1-D mesh sharded block-wise (a fused q|k|v tensor): DCP cannot address it.

    Each rank holds part r of every block, i.e. several separate chunks of the global tensor,
    while DCP records one chunk per rank. On multi-dimensional meshes FSDP2 uses the same
    placement class for a contiguous chunk, which DCP does handle.
    """
    if not _is_dtensor(t) or t.device_mesh.ndim != 1:
        return False
    return type(t.placements[0]).__name__ == "_StridedShard"


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The unsharded value of ``t`` (a DTensor or a plain tensor); collective over a DTensor's mesh.

    Block-wise shards on a 1-D mesh (a fused q|k|v weight: rank r holds part r of every block) are
    gathered here, because DTensor's own ``full_tensor`` cannot reassemble them on every torch
    version this runs on (2.11 refuses that placement).

    Example::

        w = full_tensor(model.transformer.h[0].attn.c_attn.weight)   # same on every rank
    """
    if not _strided(t):
        return t.full_tensor() if _is_dtensor(t) else t
    import torch.distributed as dist

    mesh, placement = t.device_mesh, t.placements[0]
    dim, blocks = placement.dim, placement.split_factor
    local = t.to_local().contiguous()
    parts = [torch.empty_like(local) for _ in range(mesh.size())]
    dist.all_gather(parts, local, group=mesh.get_group())
    pieces = [part.chunk(blocks, dim) for part in parts]  # pieces[r][b]: part r of block b
    return torch.cat([pieces[r][b] for b in range(blocks) for r in range(len(parts))], dim)


def _to_contiguous_shards(t):
    """``t`` (strided, see :func:`_strided`) re-laid as ``Shard(axis)``: one chunk per rank."""
    from torch.distributed.tensor import DTensor, Shard

    mesh, dim = t.device_mesh, t.placements[0].dim
    full = full_tensor(t)
    local = full.chunk(mesh.size(), dim)[mesh.get_local_rank()].clone()
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride())


def _to_strided_like(plain, like):
    """The inverse of :func:`_to_contiguous_shards`: ``plain`` laid out as ``like``."""
    from torch.distributed.tensor import DTensor

    mesh, placement = like.device_mesh, like.placements[0]
    dim, n, r = placement.dim, mesh.size(), mesh.get_local_rank()
    full = plain.full_tensor()
    # rank r holds part r of each of split_factor equal blocks (schedlang's ShardSpec.groups)
    local = torch.cat([block.chunk(n, dim)[r] for block in full.chunk(placement.split_factor, dim)], dim)
    return DTensor.from_local(local.to(like.dtype), mesh, [placement], run_check=False, shape=full.shape,
                              stride=full.stride())


def _dcp_ready(state: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``state`` with strided DTensors re-laid for DCP, and the originals of those entries."""
    out, originals = {}, {}
    for key, value in state.items():
        if _strided(value):
            originals[key] = value
            value = _to_contiguous_shards(value)
        out[key] = value
    return out, originals


def _restore_strided(state: Dict[str, Any], originals: Dict[str, Any]) -> None:
    for key, like in originals.items():
        value = _to_strided_like(state[key], like)
        with torch.no_grad():
            like.copy_(value)  # the optimizer's or the module's own tensor, updated in place
        state[key] = like


# ------------------------------------------------------------------------------------------------ meta record
def _meta_blob(step, extra, optimizer) -> bytes:
    record = {"format": FORMAT_VERSION, "step": step, "extra": extra, "world_size": _world(),
              "torch": str(torch.__version__), "optimizer": type(optimizer).__name__ if optimizer is not None else None}
    buf = io.BytesIO()
    torch.save(record, buf)
    blob = buf.getvalue()
    try:  # loading uses weights_only=True: refuse at save what could not be read back
        torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as e:
        # torch names the offending class on a line of its own ("Unsupported global: GLOBAL pathlib.PosixPath ...")
        why = next((line.strip() for line in str(e).splitlines() if "Unsupported" in line), type(e).__name__)
        raise CheckpointError(
            f"save_checkpoint: extra must hold plain Python values (dict, list, tuple, str, int, float, bool, "
            f"None) and tensors; {why}") from None
    return blob


def _read_meta(blob) -> dict:
    if isinstance(blob, (bytes, bytearray)):
        return torch.load(io.BytesIO(bytes(blob)), weights_only=True)
    return {}


# ------------------------------------------------------------------------------------------------ DCP calls
def _dcp_call(fn, state, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    no_dist = _dist() is None
    with warnings.catch_warnings():
        # DCP warns about single-process use; that is intended here
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        if fn is dcp.save:  # saving over an older checkpoint replaces it, as torch.save does a file
            fn(state, storage_writer=dcp.FileSystemWriter(path, overwrite=True), no_dist=no_dist)
        else:
            fn(state, checkpoint_id=path, no_dist=no_dist)


# ------------------------------------------------------------------------------------------------ save
def save_checkpoint(path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                    step: Optional[int] = None, extra: Any = None) -> None:
    """Write ``model``'s (and ``optimizer``'s) state to the directory ``path`` as a DCP checkpoint.

    Every rank must call it (it is collective); each writes the shards it holds. Works under any
    layout schedlang builds (DTensor tensor parallelism, FSDP2, pipeline stages, one process,
    with or without torch.distributed initialized) and with ``torch.optim`` and schedlang's fused
    optimizers. ``step`` and ``extra`` (plain Python values and tensors, e.g. a data position or an
    LR scheduler's state dict) come back from :func:`load_checkpoint`.

    Example::

        schedlang.save_checkpoint("ckpt/step-100", model, optimizer, step=100, extra={"seed": 0})
    """
    import torch.distributed.checkpoint as dcp

    started = time.perf_counter()
    path = os.fspath(path)
    blob = _meta_blob(step, extra, optimizer)
    problem = None
    if os.path.exists(path) and not os.path.isdir(path):
        problem = f"save_checkpoint: {path!r} exists and is not a directory"
    else:
        os.makedirs(path, exist_ok=True)
        if _rank() == 0 and os.path.exists(os.path.join(path, ".metadata")):
            # an older checkpoint here: without its .metadata it cannot pass for complete if this save stops midway
            os.remove(os.path.join(path, ".metadata"))
    _agree(problem)  # also keeps every rank from writing before the old .metadata is gone

    model_state, _ = _dcp_ready(_model_state(model))
    state: Dict[str, Any] = {_MODEL: model_state, _META: blob}
    was_empty = _optimizer_is_empty(optimizer)
    try:
        if optimizer is not None:
            optim_state = _OptimView(model).fetch(optimizer)
            if was_empty:
                # the state torch just created stands for "no step taken yet": save it so (see _reset_optimizer)
                optim_state = {k: _zero_step(v) if k.startswith(_STATE) and k.endswith(".step") else v
                               for k, v in optim_state.items()}
            state[_OPTIM], _ = _dcp_ready(optim_state)
        _dcp_call(dcp.save, state, path)
    finally:
        if was_empty:
            _reset_optimizer(optimizer)
    logger.info("saved checkpoint %s (%d model tensors%s, step %s) in %.2f s", path, len(model_state),
                f", {len(state[_OPTIM])} optimizer entries" if _OPTIM in state else "", step,
                time.perf_counter() - started)


# ------------------------------------------------------------------------------------------------ load
def _read_metadata(path: str):
    import torch.distributed.checkpoint as dcp

    if not os.path.isdir(path):
        return None, f"load_checkpoint: no checkpoint directory at {path!r}"
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return None, (f"load_checkpoint: {path!r} is not a complete checkpoint: its .metadata file is missing "
                      f"(written last by save_checkpoint; the save may have been interrupted)")
    try:
        return dcp.FileSystemReader(path).read_metadata(), None
    except Exception as e:  # a truncated or foreign file
        return None, f"load_checkpoint: cannot read {os.path.join(path, '.metadata')}: {e}"


def _tensor_meta(md, key):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entry = md.state_dict_metadata.get(key)
    return entry if isinstance(entry, TensorStorageMetadata) else None


def _check_tensors(kind: str, state: Dict[str, Any], md, prefix: str, path: str) -> List[str]:
    """Problems of ``state`` against the checkpoint: missing entries, other shapes."""
    problems, missing = [], []
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        entry = md.state_dict_metadata.get(prefix + key)
        if entry is None:
            missing.append(key)
            continue
        meta = _tensor_meta(md, prefix + key)
        if meta is None:
            problems.append(f"{kind} {key!r} is a tensor in the model but not in the checkpoint")
        elif tuple(meta.size) != tuple(value.shape):
            problems.append(f"shape mismatch for {kind} {key!r}: checkpoint {tuple(meta.size)}, "
                            f"model {tuple(value.shape)}")
    if missing:
        problems.insert(0, f"{len(missing)} {kind} tensor(s) of the model are missing from the checkpoint: "
                           f"{_names(missing)}")
    return problems


def _optim_template(optim_state: Dict[str, Any], md) -> Tuple[Dict[str, Any], List[str], set]:
    """What to read for the optimizer: its tensors, and the hyperparameters the checkpoint has.

    A hyperparameter the checkpoint lacks (another optimizer class saved it) keeps its value; one
    stored as a number in one and a tensor in the other is read in the checkpoint's kind.
    """
    read, skipped = {}, []
    # a parameter without any state in the checkpoint had no gradient when it was saved: it gets none here
    # either (torch created some for every parameter to build this template)
    head = f"{_OPTIM}.{_STATE}"
    saved = {k[len(head):].rpartition(".")[0] for k in md.state_dict_metadata if k.startswith(head)}
    stateless = {k[len(_STATE):].rpartition(".")[0] for k in optim_state if k.startswith(_STATE)} - saved
    for key, value in optim_state.items():
        full = f"{_OPTIM}.{key}"
        if key.startswith(_STATE):
            if key[len(_STATE):].rpartition(".")[0] not in stateless:
                read[key] = value
            continue
        entry = md.state_dict_metadata.get(full)
        if entry is None:
            skipped.append(key)
            continue
        meta = _tensor_meta(md, full)
        if meta is not None and not isinstance(value, torch.Tensor):
            read[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        elif meta is None and isinstance(value, torch.Tensor):
            read[key] = None  # bytes in the checkpoint: DCP puts the value in
        else:
            read[key] = value
    return read, skipped, stateless


def _merge_hyperparameters(optimizer, before: List[dict]) -> None:
    """Keep tensor hyperparameters (a device ``lr``) as the same tensor objects, holding the loaded value.

    A fused optimizer's kernel, a CUDA graph or an LR scheduler may hold the tensor itself.
    """
    for group, old in zip(optimizer.param_groups, before):
        for name, was in old.items():
            now = group.get(name)
            if isinstance(was, torch.Tensor):
                if now is not was and (isinstance(now, (int, float)) or (isinstance(now, torch.Tensor)
                                                                          and now.numel() == was.numel())):
                    with torch.no_grad():
                        was.copy_(torch.as_tensor(now).reshape(was.shape).to(was.dtype))
                    group[name] = was
            elif isinstance(now, torch.Tensor) and now.numel() == 1 and isinstance(was, (int, float)):
                group[name] = type(was)(now.item())


def load_checkpoint(path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``), in place.

    The model may be laid out differently from the one that saved it (tensor parallel, FSDP2,
    pipeline stages, one process, another number of ranks); every rank reads the chunks its own
    shards cover. Before anything is read, the checkpoint's ``.metadata`` is checked against the
    model and the optimizer on every rank: missing or unexpected tensors and shape mismatches raise
    :class:`~schedlang.CheckpointError` on all ranks, with nothing loaded. Returns
    ``{"step": ..., "extra": ...}`` as given to :func:`save_checkpoint`.

    Example::

        info = schedlang.load_checkpoint("ckpt/step-100", model, optimizer)
        start = info["step"] + 1
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    started = time.perf_counter()
    path = os.fspath(path)
    md, problem = _read_metadata(path)
    _agree(problem)
    ckpt_keys = set(md.state_dict_metadata)
    ckpt_model = {k[len(_MODEL) + 1:] for k in ckpt_keys if k.startswith(_MODEL + ".")}
    has_optim = any(k.startswith(_OPTIM + ".") for k in ckpt_keys)
    meta = _load_meta(path, ckpt_keys, optimizer)

    stage_keys: List[List[str]] = []
    model_state = _model_state(model, stage_keys)
    problems = _check_tensors("model", model_state, md, _MODEL + ".", path)
    was_empty = _optimizer_is_empty(optimizer)
    view, optim_read, skipped, optim_state, stateless = None, {}, [], {}, set()
    try:
        if optimizer is not None:
            if not has_optim:
                problems.append(f"load_checkpoint: {path!r} holds no optimizer state (saved without an optimizer); "
                                f"pass optimizer=None to load the model only")
            else:
                view = _OptimView(model)
                optim_state = view.fetch(optimizer)
                optim_read, skipped, stateless = _optim_template(optim_state, md)
                problems += _check_tensors("optimizer state", {k: v for k, v in optim_read.items()
                                                               if k.startswith(_STATE)}, md, _OPTIM + ".", path)
        # names in the checkpoint that no rank's model holds (each pipeline rank holds some)
        everyone = set().union(*_all_gather(sorted(k for k, v in model_state.items() if isinstance(v, torch.Tensor))))
        unexpected = {k for k in ckpt_model if _tensor_meta(md, f"{_MODEL}.{k}") is not None} - everyone
        if unexpected:
            problems.insert(0, f"{len(unexpected)} tensor(s) in the checkpoint are not in the model: "
                               f"{_names(unexpected)}")
        local = None
        if problems:
            local = f"load_checkpoint: {path!r} does not fit the model:\n  " + "\n  ".join(problems)
        _agree(local)
    except BaseException:
        if was_empty:
            _reset_optimizer(optimizer)
        raise

    if skipped:
        logger.info("the checkpoint has no value for %d optimizer hyperparameter(s) (%s); they keep their values",
                    len(skipped), _names(skipped))
    model_read, model_strided = _dcp_ready({k: v for k, v in model_state.items() if f"{_MODEL}.{k}" in ckpt_keys})
    state: Dict[str, Any] = {_MODEL: model_read}
    optim_strided = {}
    if view is not None:
        optim_read, optim_strided = _dcp_ready(optim_read)
        state[_OPTIM] = optim_read
    _dcp_call(dcp.load, state, path)

    _restore_strided(state[_MODEL], model_strided)
    merged = dict(model_state)
    merged.update(state[_MODEL])
    # DCP wrote into the tensors that the state dicts share with the parameters; set_model_state_dict
    # covers layouts whose state dicts hold copies
    for stage, keys in zip(_stages(model), stage_keys):
        set_model_state_dict(stage, {k: merged[k] for k in keys}, options=_options(strict=False))
    if view is not None:
        _restore_strided(state[_OPTIM], optim_strided)
        optim_state.update(state[_OPTIM])
        before = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        view.store(optimizer, optim_state)
        _merge_hyperparameters(optimizer, before)
        _drop_state(model, optimizer, stateless)
    logger.info("loaded checkpoint %s (%d model tensors, step %s) in %.2f s", path, len(model_read),
                meta.get("step"), time.perf_counter() - started)
    return {"step": meta.get("step"), "extra": meta.get("extra")}


def _load_meta(path: str, ckpt_keys, optimizer) -> dict:
    """The ``schedlang`` record (step, extra, format), read before anything else."""
    import torch.distributed.checkpoint as dcp

    if _META not in ckpt_keys:
        _agree(f"load_checkpoint: {path!r} was not written by save_checkpoint (it has no {_META!r} record)")
    state = {_META: b""}
    _dcp_call(dcp.load, state, path)
    meta = _read_meta(state[_META])
    problem = None
    if meta.get("format", 0) > FORMAT_VERSION:
        problem = (f"load_checkpoint: {path!r} has format {meta.get('format')}, newer than this schedlang reads "
                   f"({FORMAT_VERSION}); upgrade schedlang")
    _agree(problem)
    saved, now = meta.get("optimizer"), type(optimizer).__name__ if optimizer is not None else None
    if saved and now and saved.removeprefix("Fused") != now.removeprefix("Fused"):
        logger.warning("load_checkpoint: the optimizer state was saved from %s and is loaded into %s", saved, now)
    return meta


def _drop_state(model: nn.Module, optimizer, names) -> None:
    """Forget the state of parameters that had none when saved (they had no gradient yet)."""
    if not names:
        return
    by_name = {n: p for stage in _stages(model) for n, p in stage.named_parameters()}
    for name in names:
        p = by_name.get(name)
        if p is not None:
            optimizer.state.pop(p, None)
    for key in ("_schedlang_plans", "_schedlang_chunk_tables"):
        optimizer.__dict__.pop(key, None)


# ------------------------------------------------------------------------------------------------ export
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
    lowest of them; pipeline ranks then send what they kept to rank 0.
    """
    local = _model_state(model)
    names = [k for k, v in local.items() if isinstance(v, torch.Tensor)]
    owner: Dict[str, int] = {}
    for r, keys in enumerate(_all_gather(names)):
        for k in keys:
            owner.setdefault(k, r)
    me = _rank()
    kept: Dict[str, torch.Tensor] = {}
    for key in names:  # the same order on every rank holding the same stage (same module structure)
        value = local[key]
        if _is_dtensor(value):
            value = full_tensor(value)  # every rank of the tensor's mesh takes part
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


# Slapo's activation checkpointing names (``slapo.checkpoint.checkpoint``), which keep the
# tensor-parallel random streams in step; they live in schedlang.utils.rng_checkpoint.
def __getattr__(name):
    if name in ("checkpoint", "CheckpointFunctionWithRNGTracker"):
        from .utils import rng_checkpoint

        return getattr(rng_checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

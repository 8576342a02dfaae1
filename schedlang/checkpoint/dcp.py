"""``save_checkpoint`` / ``load_checkpoint``: distributed checkpoints (``torch.distributed.checkpoint``)
that reshard across layouts, with the optimizer state keyed by parameter name."""

from __future__ import annotations

import io
import logging
import os
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from ..distributed.dtensor_params import rank_major_specs
from ..distributed.float8_fsdp import clear_precomputed_scales
from .commit import MANIFEST, clear_staging, commit, manifest_problem, replaced_path, staging_path
from .ranks import _agree, _all_gather, _capped, _dist, _names, _rank, _world
from .experts import expert_views, full_shape_view
from .state import (_STATE, _dcp_ready, _is_dtensor, _model_state, _OptimView, _optimizer_is_empty, _options,
                    _reset_optimizer, _restore_strided, _stages, _zero_step)

logger = logging.getLogger("schedlang.checkpoint")

#: version of the ``schedlang`` record inside a checkpoint
FORMAT_VERSION = 1
_MODEL, _OPTIM, _META = "model", "optim", "schedlang"


def _meta_blob(step, extra, optimizer) -> Tuple[Optional[bytes], Optional[str]]:
    """The pickled ``schedlang`` record, or None and why ``extra`` cannot be saved (a problem for :func:`_agree`)."""
    record = {"format": FORMAT_VERSION, "step": step, "extra": extra, "world_size": _world(),
              "torch": str(torch.__version__), "optimizer": type(optimizer).__name__ if optimizer is not None else None}
    problem = ("save_checkpoint: extra must hold plain Python values (dict, list, tuple, str, int, float, bool, "
               "None) and tensors; {why}")
    buf = io.BytesIO()
    try:  # a lambda, a lock, a local class: pickle refuses it (PicklingError, AttributeError or TypeError)
        torch.save(record, buf)
    except Exception as e:
        return None, problem.format(why=f"{type(e).__name__}: {_first_line(e)}")
    blob = buf.getvalue()
    try:  # loading uses weights_only=True: refuse at save what could not be read back
        torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as e:
        # torch names the offending class on a line of its own ("Unsupported global: GLOBAL pathlib.PosixPath ...")
        why = next((line.strip() for line in str(e).splitlines() if "Unsupported" in line), type(e).__name__)
        return None, problem.format(why=why)
    return blob, None


def _first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an error's message, cut at ``limit`` characters (torch's can run to a paragraph)."""
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else type(error).__name__
    return line if len(line) <= limit else line[:limit] + "..."


def _argument_problem(where: str, path, model, optimizer) -> Optional[str]:
    """Why ``path``, ``model`` or ``optimizer`` cannot be used (for :func:`_agree`), before anything is read or
    written; else None."""
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        return (f"{where}: path must be a directory path (a str or os.PathLike), got {type(path).__name__} "
                f"{path!r}")
    if not isinstance(model, nn.Module):
        hint = ("; build the schedule first: model, opt = schedlang.build(sch)"
                if type(model).__name__ == "Schedule" else "")
        return (f"{where}: model must be a torch.nn.Module (the model schedlang.build returns), got "
                f"{type(model).__name__} {_short_repr(model)}{hint}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        return (f"{where}: optimizer must be a torch.optim.Optimizer over the model's parameters, or None for the "
                f"model alone, got {type(optimizer).__name__} {_short_repr(optimizer)}")
    return _plain_shard_problem(where, model)


def _plain_shard_problem(where: str, model: nn.Module) -> Optional[str]:
    """A model built from a schedule without a mesh holds its shards as plain tensors (Slapo's model): DCP would
    take every rank's shard for the whole tensor. Refused, naming the first one."""
    from ..module_record import shard_specs

    for path, module in model.named_modules():
        for name, spec in shard_specs(module).items():
            t = module._parameters.get(name)
            t = module._buffers.get(name) if t is None else t
            if t is not None and spec.world_size > 1 and not _is_dtensor(t):
                full = f"{path}.{name}" if path else name
                return (f"{where}: {full!r} is a plain local shard (rank {spec.rank} of {spec.world_size}, of "
                        f"{tuple(spec.full_shape)}): the schedule was made without a mesh, so build kept its shards "
                        "plain tensors, whose layout a checkpoint cannot record; create the schedule with a mesh "
                        "(schedlang.create_schedule(model, mesh=make_mesh(tp=...))) to checkpoint it")
    return None


def _short_repr(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _read_meta(blob) -> dict:
    if isinstance(blob, (bytes, bytearray)):
        return torch.load(io.BytesIO(bytes(blob)), weights_only=True)
    return {}


# ------------------------------------------------------------------------------------------------ DCP calls
def _dcp_call(fn, state, path: str) -> None:
    no_dist = _dist() is None
    with warnings.catch_warnings():
        # DCP warns about single-process use; that is intended here
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        fn(state, checkpoint_id=path, no_dist=no_dist)


def _dcp_load(state: Dict[str, Any], path: str) -> None:
    """``dcp.load`` into ``state``; a failure on any rank raises the same :class:`CheckpointError` on every rank.

    DCP reports a failed read as a ``CheckpointException``, a ``BaseException`` that ``except Exception``
    does not catch, and names the underlying error of each rank only inside it.
    """
    import torch.distributed.checkpoint as dcp

    problem = None
    try:
        _dcp_call(dcp.load, state, path)
    except (Exception, dcp.CheckpointException) as e:
        why = _exception_text(e)
        problem = (f"load_checkpoint: cannot read {path!r}: {why}; check that every file of the checkpoint was "
                   "written and copied whole, or load an earlier checkpoint; the model and optimizer are unchanged")
    _agree(problem, damaged=True)


def _exception_text(error: BaseException) -> str:
    """What failed, in one line per rank: DCP's ``CheckpointException`` carries each rank's own exception
    (``{rank: (exception, traceback)}``), and its message is the tracebacks."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {rank}: {_failure_text(failure)}" for rank, failure in sorted(failures.items()))
    return f"{type(error).__name__}: {_first_line(error)}"


def _failure_text(failure) -> str:
    error = failure[0] if isinstance(failure, tuple) and failure else failure
    return f"{type(error).__name__}: {_first_line(error)}" if isinstance(error, BaseException) else str(failure)


def _staging(state: Dict[str, Any], fresh: Dict[str, Any]) -> Dict[str, Any]:
    """``state`` with every tensor swapped for a new uninitialized one of the same layout (dtype, device, strides;
    for a DTensor also its mesh, placements and global shape), for DCP to read into; the entries in ``fresh``
    are already new tensors (re-laid by :func:`_dcp_ready`) and stay. Costs the memory of the tensors read."""
    staged = {}
    with torch.no_grad():
        for key, value in state.items():
            if key in fresh or not isinstance(value, torch.Tensor):
                staged[key] = value  # non-tensors (bytes, numbers): DCP puts the loaded value in the dict
            elif _is_dtensor(value):
                from torch.distributed.tensor import DTensor

                staged[key] = DTensor.from_local(torch.empty_like(value.to_local()), value.device_mesh,
                                                 value.placements, run_check=False, shape=value.shape,
                                                 stride=value.stride())
            else:
                staged[key] = torch.empty_like(value)
    return staged


def _commit(staged: Dict[str, Any], targets: Dict[str, Any]) -> None:
    """Copy what DCP read into ``staged`` into the tensors of ``targets`` (the model's and the optimizer's own,
    in place, so that anything holding them sees the values), and put those back in ``staged``."""
    with torch.no_grad():
        for key, target in targets.items():
            loaded = staged[key]
            if not isinstance(target, torch.Tensor) or loaded is target:
                continue
            if _is_dtensor(target):  # same mesh and placements: each rank copies its own shard
                target.to_local().copy_(loaded.to_local())
            else:
                target.copy_(loaded)
            staged[key] = target


# ------------------------------------------------------------------------------------------------ save
#: names a checkpoint's own files take; ``extra_files`` may not use them
_RESERVED = (".metadata", MANIFEST)


def _extra_files_problem(extra_files) -> Optional[str]:
    if extra_files is None:
        return None
    if not isinstance(extra_files, dict):
        return (f"save_checkpoint: extra_files must be a dict of file name -> str or bytes, got "
                f"{type(extra_files).__name__}")
    for name, contents in extra_files.items():
        if (not isinstance(name, str) or not name or name != os.path.basename(name) or name in (".", "..")
                or name in _RESERVED or name.endswith(".distcp")):
            return (f"save_checkpoint: extra_files: {name!r} is not a valid name: give a plain file name (no "
                    f"directory), other than {', '.join(_RESERVED)} and *.distcp, which the checkpoint uses")
        if not isinstance(contents, (str, bytes)):
            return (f"save_checkpoint: extra_files[{name!r}] must be str or bytes, got {type(contents).__name__}")
    return None


class _SaveState:
    """What one save writes: the DCP state of the model (and optimizer), where it is staged, and how to put
    an optimizer that had no state back as it was once the state has been written (or copied, for an
    asynchronous save)."""

    def __init__(self, path: str, state: Dict[str, Any], optimizer, was_empty: bool, started: float, step):
        self.path, self.state, self.optimizer, self.was_empty = path, state, optimizer, was_empty
        self.started, self.step = started, step
        self.staging = staging_path(path)

    def release(self) -> None:
        if self.was_empty:
            _reset_optimizer(self.optimizer)
            self.was_empty = False

    def describe(self) -> str:
        n_optim = len(self.state[_OPTIM]) if _OPTIM in self.state else 0
        return (f"{len(self.state[_MODEL])} model tensors" + (f", {n_optim} optimizer entries" if n_optim else "")
                + f", step {self.step}")


def _begin_save(path, model, optimizer, step, extra, extra_files) -> _SaveState:
    """Check the arguments (agreed between the ranks before anything is written), empty the staging directory
    and gather the state to write."""
    started = time.perf_counter()
    problem = _argument_problem("save_checkpoint", path, model, optimizer)
    blob = None
    if problem is None:
        problem = _extra_files_problem(extra_files)
    if problem is None:
        blob, problem = _meta_blob(step, extra, optimizer)
    if problem is None and os.path.exists(path) and not os.path.isdir(path):
        problem = f"save_checkpoint: {os.fspath(path)!r} exists and is not a directory; pass a directory path"
    _agree(problem)
    path = os.fspath(path).rstrip(os.sep) or os.sep
    problem = None
    if _rank() == 0:
        try:  # what an interrupted save of this path left is never loaded; it is replaced now
            clear_staging(path)
        except OSError as e:
            problem = (f"save_checkpoint: cannot create {staging_path(path)!r} ({e.strerror or e}); give a "
                       "checkpoint path in a writable directory")
    _agree(problem)  # also keeps every rank from writing before the staging directory is ready

    rank_major = rank_major_specs(_stages(model))
    experts = expert_views(_stages(model))
    model_state, _ = _dcp_ready(_model_state(model), rank_major, experts)
    state: Dict[str, Any] = {_MODEL: model_state, _META: blob}
    was_empty = _optimizer_is_empty(optimizer)
    save = _SaveState(path, state, optimizer, was_empty, started, step)
    try:
        if optimizer is not None:
            optim_state = _OptimView(model).fetch(optimizer)
            if was_empty:
                # the state torch just created stands for "no step taken yet": save it so (see _reset_optimizer)
                optim_state = {k: _zero_step(v) if k.startswith(_STATE) and k.endswith(".step") else v
                               for k, v in optim_state.items()}
            state[_OPTIM], _ = _dcp_ready(optim_state, rank_major, experts)
    except BaseException:
        save.release()
        raise
    return save


def _commit_problem(path: str, step, extra_files) -> Optional[str]:
    """Rank 0, once every rank's shards are written: make the checkpoint visible (:func:`commit.commit`)."""
    try:
        commit(path, step=step, files=extra_files)
    except OSError as e:
        return (f"save_checkpoint: the checkpoint was written to {staging_path(path)!r} but could not be made "
                f"visible as {path!r} ({type(e).__name__}: {e}); it stays incomplete and is never loaded")
    return None


def save_checkpoint(path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                    step: Optional[int] = None, extra: Any = None,
                    extra_files: Optional[Dict[str, Union[str, bytes]]] = None) -> None:
    """Write ``model``'s (and ``optimizer``'s) state to the directory ``path`` as a DCP checkpoint.

    Every rank must call it (it is collective); each writes the shards it holds. Works under any
    layout schedlang builds (DTensor tensor parallelism, FSDP2, pipeline stages, one process,
    with or without torch.distributed initialized) and with ``torch.optim`` and schedlang's fused
    optimizers. ``step`` and ``extra`` (plain Python values and tensors, e.g. a data position or an
    LR scheduler's state dict) come back from :func:`load_checkpoint`. ``extra_files`` (file name ->
    str or bytes) are written by rank 0 into the checkpoint directory, e.g. a JSON state that tools
    read without torch.

    The checkpoint appears at ``path`` only once it is complete: the ranks write into
    ``<path>.partial``, and rank 0 renames it after every rank finished, with a ``manifest.json``
    that :func:`load_checkpoint` checks (see :mod:`schedlang.checkpoint.commit`). A save that is cut
    off leaves only the ``.partial`` directory; a checkpoint already at ``path`` stays whole until
    the new one replaces it.

    Example::

        schedlang.save_checkpoint("ckpt/step-100", model, optimizer, step=100, extra={"seed": 0})
    """
    import torch.distributed.checkpoint as dcp

    save = _begin_save(path, model, optimizer, step, extra, extra_files)
    try:
        _dcp_call(dcp.save, save.state, save.staging)
    finally:
        save.release()
    _agree(_commit_problem(save.path, step, extra_files) if _rank() == 0 else None)
    logger.info("saved checkpoint %s (%s) in %.2f s", save.path, save.describe(), time.perf_counter() - save.started)


# ------------------------------------------------------------------------------------------------ load
def _read_metadata(path: str):
    """The checkpoint's DCP metadata, or None and why it cannot be loaded; a third value says whether that is
    damage (a file missing, cut short, unreadable: an earlier checkpoint may still load)."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isdir(path):
        if os.path.isdir(replaced_path(path)):
            return None, (f"load_checkpoint: {path!r} is not a complete checkpoint: a save over it was cut off "
                          f"between its renames; the checkpoint it replaced is whole in {replaced_path(path)!r} "
                          "(the next save_checkpoint of this path, or the trainer's --resume, moves it back)"), True
        if os.path.isdir(staging_path(path)):
            return None, (f"load_checkpoint: {path!r} is not a complete checkpoint: only {staging_path(path)!r} "
                          "exists, the directory of a save that did not finish"), True
        return None, f"load_checkpoint: no checkpoint directory at {path!r}", False
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return None, (f"load_checkpoint: {path!r} is not a complete checkpoint: its .metadata file is missing "
                      f"(written last by save_checkpoint; the save may have been interrupted)"), True
    try:
        md = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # a truncated or foreign file
        return None, f"load_checkpoint: cannot read {os.path.join(path, '.metadata')}: {e}", True
    problem = _data_file_problem(path, md)
    if problem is None:
        mismatch = manifest_problem(path)
        if mismatch is not None:
            problem = (f"load_checkpoint: {path!r} is not a complete checkpoint: {mismatch}; check that every file "
                       "of the checkpoint was written and copied whole, or load an earlier checkpoint; nothing was "
                       "loaded")
    return md, problem, problem is not None


def checkpoint_problem(path) -> Optional[str]:
    """Why the directory ``path`` is not a complete checkpoint (no ``.metadata``, a data file missing or cut
    short, files that differ from its manifest), or None when it is; reads nothing but ``.metadata`` and
    the manifest (one process, no collective). Whether it fits a model is checked by :func:`load_checkpoint`.
    """
    return _read_metadata(os.fspath(path))[1]


def _data_file_problem(path: str, md) -> Optional[str]:
    """Which data files the ``.metadata`` names are missing or shorter than the data it places in them.

    Checked before anything is read: DCP would fail only on the rank that reads the file, midway through
    the load; only the file sizes are looked at, so this costs a ``stat`` per file.
    """
    needed: Dict[str, int] = {}  # file -> the end of the last byte range the .metadata places in it
    for info in (getattr(md, "storage_data", None) or {}).values():
        name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if isinstance(name, str) and isinstance(offset, int) and isinstance(length, int):
            needed[name] = max(needed.get(name, 0), offset + length)
    problems = []
    for name, end in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            problems.append(f"{file} is missing")
        elif os.path.getsize(file) < end:
            problems.append(f"{file} is truncated ({os.path.getsize(file)} bytes; the .metadata places data up to "
                            f"byte {end})")
    if not problems:
        return None
    return (f"load_checkpoint: {path!r} is not a complete checkpoint: {'; '.join(problems)}; check that every "
            "file of the checkpoint was written and copied whole, or load an earlier checkpoint; nothing was loaded")


def _tensor_meta(md, key):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entry = md.state_dict_metadata.get(key)
    return entry if isinstance(entry, TensorStorageMetadata) else None


def _check_tensors(kind: str, state: Dict[str, Any], md, prefix: str, path: str) -> List[str]:
    """Problems of ``state`` against the checkpoint: missing entries, other shapes."""
    problems, missing, shapes = [], [], []
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
            shapes.append(f"shape mismatch for {kind} {key!r}: checkpoint {tuple(meta.size)}, "
                          f"model {tuple(value.shape)}")
    problems += _capped(shapes, f"{kind} shape mismatches")
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
    :class:`~schedlang.CheckpointError` on all ranks, with nothing loaded. So do missing or truncated
    data files, and a read that fails midway (a corrupt file): the tensors are read into new ones of the
    same layout first and copied into the model and the optimizer only once every rank read all of
    them, which takes as much extra memory, for the duration of the call, as the tensors this rank holds.
    Returns ``{"step": ..., "extra": ...}`` as given to :func:`save_checkpoint`.

    Example::

        info = schedlang.load_checkpoint("ckpt/step-100", model, optimizer)
        start = info["step"] + 1
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    started = time.perf_counter()
    _agree(_argument_problem("load_checkpoint", path, model, optimizer))
    path = os.fspath(path)
    md, problem, damaged = _read_metadata(path)
    _agree(problem, damaged)
    ckpt_keys = set(md.state_dict_metadata)
    ckpt_model = {k[len(_MODEL) + 1:] for k in ckpt_keys if k.startswith(_MODEL + ".")}
    has_optim = any(k.startswith(_OPTIM + ".") for k in ckpt_keys)
    meta = _load_meta(path, ckpt_keys, optimizer)

    stage_keys: List[List[str]] = []
    model_state = _model_state(model, stage_keys)
    experts = expert_views(_stages(model))  # expert slices: checked and read as the full weights
    problems = _check_tensors("model", full_shape_view(model_state, experts), md, _MODEL + ".", path)
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
                problems += _check_tensors("optimizer state", full_shape_view(
                    {k: v for k, v in optim_read.items() if k.startswith(_STATE)}, experts), md, _OPTIM + ".", path)
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
    rank_major = rank_major_specs(_stages(model))
    model_read, model_strided = _dcp_ready({k: v for k, v in model_state.items() if f"{_MODEL}.{k}" in ckpt_keys},
                                           rank_major, experts)
    # DCP reads into staging tensors, not into the model's and the optimizer's own: a read that fails midway
    # (a corrupt file) must leave both as they were; they receive the values once every rank read everything
    state: Dict[str, Any] = {_MODEL: _staging(model_read, model_strided)}
    optim_strided = {}
    if view is not None:
        optim_read, optim_strided = _dcp_ready(optim_read, rank_major, experts)
        state[_OPTIM] = _staging(optim_read, optim_strided)
    try:
        _dcp_load(state, path)
    except BaseException:
        if was_empty:
            _reset_optimizer(optimizer)
        raise
    _commit(state[_MODEL], model_read)
    if view is not None:
        _commit(state[_OPTIM], optim_read)

    _restore_strided(state[_MODEL], model_strided)
    merged = dict(model_state)
    merged.update(state[_MODEL])
    # DCP wrote into the tensors that the state dicts share with the parameters; set_model_state_dict
    # covers layouts whose state dicts hold copies
    for stage, keys in zip(_stages(model), stage_keys):
        set_model_state_dict(stage, {k: merged[k] for k in keys}, options=_options(strict=False))
        clear_precomputed_scales(stage)  # float8 scales stored for the weights just replaced
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
    if _META not in ckpt_keys:
        _agree(f"load_checkpoint: {path!r} was not written by save_checkpoint (it has no {_META!r} record)")
    state = {_META: b""}
    _dcp_load(state, path)
    problem, meta, damaged = None, {}, False
    try:
        meta = _read_meta(state[_META])
    except Exception as e:  # bytes that are not the pickled record save_checkpoint wrote
        problem, damaged = (f"load_checkpoint: cannot read the {_META!r} record of {path!r} ({type(e).__name__}: "
                            f"{_first_line(e)}); check that the checkpoint was copied whole; nothing was loaded"), True
    if problem is None and meta.get("format", 0) > FORMAT_VERSION:
        problem = (f"load_checkpoint: {path!r} has format {meta.get('format')}, newer than this schedlang reads "
                   f"({FORMAT_VERSION}); upgrade schedlang")
    _agree(problem, damaged)
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

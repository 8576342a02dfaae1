"""Pretrained weights from HF safetensors, each rank reading only the slices it holds.

``schedlang.build(sch, pretrained=DIR)`` materializes a model made under
:func:`schedlang.init_empty_weights` from a HuggingFace checkpoint directory (``model.safetensors``,
or ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``), a single
``.safetensors`` file or a list of them; :func:`load_pretrained` does the same for a model that is
already built. Either way:

* **Only this rank's slices are read.** The tensors are loaded into the *built* model, after
  tensor parallelism (DTensor parameters), pipeline stages and FSDP2 are in place. A DTensor's
  placements say which indices of the unsharded tensor its local shard holds: ``Shard(d)`` one
  chunk of dimension ``d``, ``_StridedShard(d, split_factor=k)`` part r of each of k blocks (a
  fused q|k|v or gate|up weight, and FSDP2's shard of a tensor-parallel shard); a fused weight of
  blocks of unequal widths (Phi-3's q|k|v with fewer key/value heads) is ``Shard(d)`` of its
  rank-major rows, mapped back through its ``ShardSpec`` (``ShardSpec.rank_major``). A schedule made
  without a mesh keeps its shards plain local tensors: the ``ShardSpec`` in the module's record says
  which part each holds, the same part a DTensor of that shard would hold. Each contiguous
  run of those indices is read with safetensors' lazy slicing (``safe_open(...).get_slice(name)
  [a:b, c:d]``), so no rank ever holds a full tensor it does not keep. HF's ``Conv1D`` (GPT-2)
  stores its weight as (in, out) in the checkpoint and in the module alike, and schedlang's shard
  rules keep that layout: its shards are plain slices of the stored tensor, nothing is transposed.
* **Memory.** A file is opened per tensor (safetensors maps it into memory; closing it drops the
  pages read), so a rank's peak host memory is its own share plus about one tensor's slice. The
  model is allocated empty (``torch.empty``, at its sharded size) and never initialized, except
  for the tensors the checkpoint does not hold (non-persistent buffers such as rotary caches keep
  the values the model computed in ``__init__``).
* **Names and shapes are checked first**, on every rank, before anything is allocated or read: a
  name the checkpoint has and the model lacks, a name the model has and the checkpoint lacks, and
  a shape mismatch each raise :class:`~schedlang.CheckpointError` naming the tensor, both shapes
  and the file, on all ranks, with nothing loaded. Tied weights are read once through whichever
  name the checkpoint holds (``lm_head.weight`` is usually left out when it is tied to the
  embedding), also when a pipeline keeps a copy of the tie on another rank. A checkpoint of the
  base model (``layers.0...`` without ``model.``) loads into the LM, as ``from_pretrained`` allows.
* **dtypes.** Each slice is converted to the dtype of the tensor it is copied into (a bf16
  checkpoint into fp32 master weights, or the reverse with ``build(..., dtype=torch.bfloat16)``).

Example::

    with schedlang.init_empty_weights():
        model = LlamaForCausalLM(LlamaConfig.from_pretrained("ckpt/tinyllama"))
    sch = schedlang.create_schedule(model, mesh=make_mesh(tp=2))
    shard_model(sch)
    model, opt = schedlang.build(sch, pretrained="ckpt/tinyllama", optimizer="adamw", lr=1e-5)
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .checkpoint.ranks import _agree, _all_gather, _capped, _names, _rank
from .errors import CheckpointError

__all__ = ["load_pretrained", "PretrainedWeights", "SAFETENSORS_INDEX", "local_regions", "read_index"]

logger = logging.getLogger("schedlang.pretrained")

#: the index file of a checkpoint split over several safetensors files
SAFETENSORS_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _shape(shape) -> str:
    return str(tuple(int(s) for s in shape))


# ------------------------------------------------------------------------------------------------ files
def _safe_open(path: str):
    from safetensors import safe_open  # looked up at each call, so a test can wrap it

    return safe_open(path, framework="pt")


@dataclass(frozen=True)
class _Entry:
    """One tensor of the checkpoint: where it is and what it is (read from the file's header)."""

    name: str
    file: str
    shape: Tuple[int, ...]
    dtype: str


def _checkpoint_files(source) -> Tuple[List[str], Optional[Dict[str, str]], str]:
    """``(files, weight map of the index or None, description)`` for a directory, a file or a list of files."""
    if isinstance(source, (list, tuple)):
        files = [os.fspath(f) for f in source]
        if not files:
            raise CheckpointError("pretrained: an empty list of files was given; pass a checkpoint directory, a "
                                  ".safetensors file or a list of them")
        return files, None, f"{len(files)} file(s)"
    try:
        path = os.fspath(source)
    except TypeError:
        raise CheckpointError(f"pretrained: expected a directory, a .safetensors file or a list of them, got "
                              f"{type(source).__name__}") from None
    if os.path.isfile(path):
        if os.path.basename(path) == SAFETENSORS_INDEX:
            path = os.path.dirname(path) or "."
        else:
            return [path], None, path
    if not os.path.isdir(path):
        raise CheckpointError(f"pretrained: {path!r} does not exist (expected a checkpoint directory holding "
                              f"{_SINGLE} or {SAFETENSORS_INDEX}, or a .safetensors file)")
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"pretrained: cannot read the weight map of {index}: {type(e).__name__}: {e}; the "
                                  "index must be JSON with a \"weight_map\" object") \
                from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"pretrained: {index}: 'weight_map' must map tensor names to file names")
        weight_map = {k: os.path.join(path, v) for k, v in weight_map.items()}
        return sorted(set(weight_map.values())), weight_map, path
    if os.path.isfile(os.path.join(path, _SINGLE)):
        return [os.path.join(path, _SINGLE)], None, path
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"pretrained: {path!r} holds no .safetensors file (expected {_SINGLE}, or "
                              f"{SAFETENSORS_INDEX} with the files it names); a PyTorch .bin checkpoint can be "
                              f"converted with transformers' save_pretrained")
    return files, None, path


def read_index(source) -> Tuple[Dict[str, _Entry], str]:
    """Every tensor of the checkpoint ``source`` (name -> :class:`_Entry`), from the files' headers only."""
    files, weight_map, where = _checkpoint_files(source)
    entries: Dict[str, _Entry] = {}
    for file in files:
        if not os.path.isfile(file):
            raise CheckpointError(f"pretrained: {file} is missing (named by {where}/{SAFETENSORS_INDEX}); check that "
                                  "the checkpoint folder is complete"
                                  if weight_map is not None else f"pretrained: {file} does not exist; pass a "
                                  "safetensors file or a folder that holds one")
        try:
            with _safe_open(file) as handle:
                for name in handle.keys():
                    piece = handle.get_slice(name)
                    entry = _Entry(name, file, tuple(int(s) for s in piece.get_shape()), str(piece.get_dtype()))
                    if weight_map is not None and weight_map.get(name) != file:
                        continue  # the index says which file holds it (a stale copy elsewhere is not read)
                    if name in entries:
                        raise CheckpointError(f"pretrained: tensor {name!r} is in both {entries[name].file} and "
                                              f"{file}; pass the files of one checkpoint")
                    entries[name] = entry
        except CheckpointError:
            raise
        except Exception as e:  # not a safetensors file, truncated header ...
            raise CheckpointError(f"pretrained: cannot read {file} as safetensors: {type(e).__name__}: {e}; check "
                                  "that the file is complete") from None
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(entries))
        if absent:
            raise CheckpointError(f"pretrained: {where}/{SAFETENSORS_INDEX} names {len(absent)} tensor(s) that "
                                  f"are not in the files it points to: {_names(absent)}")
    return entries, where


# ------------------------------------------------------------------------------------------------ regions
def _runs(indices: torch.Tensor) -> List[Tuple[int, int, int]]:
    """``(local offset, global start, length)`` of each contiguous run of ascending ``indices``."""
    if indices.numel() == 0:
        return []
    breaks = (torch.nonzero(indices[1:] - indices[:-1] != 1).flatten() + 1).tolist()
    starts, ends = [0] + breaks, breaks + [indices.numel()]
    return [(a, int(indices[a]), b - a) for a, b in zip(starts, ends)]


def local_regions(tensor: torch.Tensor, spec=None) -> List[Tuple[Tuple[slice, ...], Tuple[slice, ...]]]:
    """Where this rank's local part of ``tensor`` (a DTensor or a plain tensor) lies in the unsharded one.

    A list of ``(local index, global index)`` pairs of slices, one per block: a ``Shard`` or FSDP2
    shard is one block; a block-wise shard of a fused tensor (q|k|v) is one block per part.
    ``spec``: the tensor's ``ShardSpec`` (its module's record). A DTensor's placements say which part
    it holds; its spec matters only when it is laid out rank-major (blocks of unequal widths, see
    :attr:`ShardSpec.rank_major`): its indices are mapped back to the unsharded tensor's (found by
    itself for a built model's parameters). A plain tensor with a spec is a local shard (a schedule
    built without a mesh): it holds the part a DTensor of that spec would hold on rank ``spec.rank``;
    without one it is the whole tensor.

    Example::

        local_regions(c_attn.weight)   # (32, 96) as _StridedShard(1, split_factor=3), rank 1 of 2:
        # [((:, 0:16), (:, 16:32)), ((:, 16:32), (:, 48:64)), ((:, 32:48), (:, 80:96))]
    """
    from .distributed.dtensor_params import is_dtensor, placement_indices, placement_of, rank_major_spec

    if is_dtensor(tensor):
        mesh = tensor.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:  # this rank is not in the tensor's mesh: it holds nothing of it
            return []
        global_shape, placements = tuple(tensor.shape), tuple(tensor.placements)
        indices = placement_indices(global_shape, placements, coordinate, [mesh.size(d) for d in range(mesh.ndim)])
        spec = spec if spec is not None and spec.rank_major else rank_major_spec(tensor)
        local_shape = tuple(tensor.to_local().shape)
    elif spec is not None:
        # the same indices a DTensor of this shard would hold: one mapping of a global tensor to a rank's part
        global_shape, placements = tuple(spec.full_shape), (placement_of(spec),)
        indices = placement_indices(global_shape, placements, [spec.rank], [spec.world_size])
        local_shape = tuple(tensor.shape)
    else:
        full = tuple(slice(0, int(n)) for n in tensor.shape)
        return [(full, full)]
    if spec is not None and spec.rank_major:  # its index j is index order[j] of the unsharded tensor
        indices[spec.axis] = spec.rank_major_order()[indices[spec.axis]]
    if tuple(len(i) for i in indices) != local_shape:
        raise CheckpointError(f"pretrained: cannot tell which part of a tensor of shape {_shape(global_shape)} "
                              f"placed as {placements} this rank holds (computed "
                              f"{_shape(len(i) for i in indices)}, local {_shape(local_shape)}); the placements read are "
                              "Shard, _StridedShard, Replicate and Partial")
    regions = []
    for combo in itertools.product(*[_runs(i) for i in indices]):
        regions.append((tuple(slice(o, o + n) for o, _, n in combo), tuple(slice(g, g + n) for _, g, n in combo)))
    return regions


# ------------------------------------------------------------------------------------------------ the model side
@dataclass
class _Target:
    name: str
    tensor: torch.Tensor
    full_shape: Tuple[int, ...]
    spec: Any = None  # its ShardSpec, when the schedule sharded it

    def shard_note(self) -> str:
        """What this rank holds of a sharded tensor, for a shape mismatch ("" when it holds all of it): a DTensor's
        local shape and placements, a plain local shard's shape and how its record splits it."""
        from .distributed.dtensor_params import is_dtensor

        if is_dtensor(self.tensor):
            local = _shape(self.tensor.to_local().shape)
            return "" if local == _shape(self.full_shape) else \
                f"; this rank's shard is {local}, placed as {tuple(self.tensor.placements)}"
        spec = self.spec
        if spec is None or spec.world_size == 1:
            return ""
        blocks = f" in {spec.groups} blocks" if spec.groups > 1 else ""
        return f"; this rank's shard is {_shape(self.tensor.shape)}, split along axis {spec.axis}{blocks} over " \
               f"{spec.world_size} ranks"


def _stages(model: nn.Module) -> List[nn.Module]:
    stages = getattr(model, "stage_modules", None)
    return [model] if stages is None else list(stages)


def _meta_targets(model: nn.Module) -> List[_Target]:
    """The persistent tensors of an unbuilt model, with their unsharded shapes (from the shard records)."""
    from .distributed.sharding import shard_specs

    out = []
    for path, module in model.named_modules(remove_duplicate=False):
        specs = shard_specs(module)
        stores = [(module._parameters, ()), (module._buffers, module._non_persistent_buffers_set)]
        for store, skip in stores:
            for name, t in store.items():
                if t is None or name in skip:
                    continue
                spec = specs.get(name)
                full = tuple(spec.full_shape) if spec is not None else tuple(t.shape)
                out.append(_Target(f"{path}.{name}" if path else name, t, full, spec))
    return out


def _built_targets(model: nn.Module) -> Tuple[List[_Target], List[Tuple[nn.Module, Dict[str, Any]]]]:
    """The persistent tensors this rank holds in a built model (every stage it holds) with their global
    shapes, and the state dict of each stage module whose state dict holds other tensors than its own
    (written back after the read, as ``load_checkpoint`` does).

    A DTensor's global shape is its own; a plain local shard's (a schedule built without a mesh) is the
    unsharded shape its module's record gives."""
    from .distributed.dtensor_params import is_dtensor, named_shard_specs

    out, seen, states = [], set(), []
    specs = named_shard_specs(_stages(model))
    for stage in _stages(model):
        state, copies = _state_dict_of(stage)
        if copies:
            states.append((stage, state))
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and name not in seen:
                seen.add(name)
                spec = specs.get(name)
                full = tuple(value.shape) if is_dtensor(value) or spec is None else tuple(spec.full_shape)
                out.append(_Target(name, value, full, spec))
    return out, states


def _state_dict_of(stage: nn.Module) -> Tuple[Dict[str, Any], bool]:
    """``(state dict, whether its tensors may be copies)`` of a built stage module.

    A model with no wrapper module gives its own tensors under their model names (``keep_vars``: the parameters and
    buffers themselves, DTensors and FSDP2's shards included), which the read writes into directly. A wrapped one
    goes through torch's distributed state dict, which unwraps the names but may hand out copies."""
    from .distributed.dtensor_params import WRAPPER_NAMES

    wrapped = any(part in WRAPPER_NAMES for name, _ in stage.named_modules() for part in name.split("."))
    if not wrapped:
        return stage.state_dict(keep_vars=True), False
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(stage), True


def _hf_class_attr(model: nn.Module, attr: str):
    for stage in [model] + _stages(model):
        value = getattr(type(getattr(stage, "_orig_mod", stage)), attr, None)
        if value:
            return value
    return None


def _config(model: nn.Module):
    for stage in [model] + _stages(model):
        config = getattr(stage, "config", None)
        if config is not None:
            return config
    return None


@dataclass
class _Naming:
    """What the name matching needs to know of the model's class (read from the unsplit model when there is one)."""

    prefix: str
    ignore_missing: List[Any]
    ignore_unexpected: List[Any]
    ties: List[List[str]]

    @classmethod
    def of(cls, model: nn.Module, targets: Sequence[_Target]) -> "_Naming":
        by_id: Dict[int, List[str]] = {}
        for t in targets:  # one tensor under several names
            by_id.setdefault(id(t.tensor), []).append(t.name)
        ties = [g for g in by_id.values() if len(g) > 1]
        for tied in getattr(model, "_tied", ()) or ():  # PipelinedModel: a tie kept on several pp ranks
            ties.append(list(tied.names))
        pairs = _hf_class_attr(model, "_tied_weights_keys")
        if isinstance(pairs, dict) and getattr(_config(model), "tie_word_embeddings", None) is not False:
            ties += [[target, source] for target, source in pairs.items()]
        return cls(_hf_class_attr(model, "base_model_prefix") or "",
                   [re.compile(p) for p in (_hf_class_attr(model, "_keys_to_ignore_on_load_missing") or ())],
                   [re.compile(p) for p in (_hf_class_attr(model, "_keys_to_ignore_on_load_unexpected") or ())],
                   ties)

    def merged(self, other: Optional["_Naming"]) -> "_Naming":
        """This naming completed by ``other`` (the unsplit model's, for a pipeline's stage modules)."""
        if other is None:
            return self
        return _Naming(self.prefix or other.prefix, self.ignore_missing or other.ignore_missing,
                       self.ignore_unexpected or other.ignore_unexpected, self.ties + other.ties)


# ------------------------------------------------------------------------------------------------ matching
class _Plan:
    """Which checkpoint tensor each model name reads, and what does not fit (found before any read)."""

    def __init__(self, what: str, targets: Sequence[_Target], naming: _Naming, entries: Dict[str, _Entry],
                 where: str, strict: bool, gather_names: bool):
        self.source: Dict[str, str] = {}  # model name -> checkpoint name
        prefix = naming.prefix

        def direct(name: str) -> Optional[str]:
            if name in entries:
                return name
            if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in entries:
                return name[len(prefix) + 1:]  # a base-model checkpoint loaded into the LM
            if prefix and f"{prefix}.{name}" in entries:
                return f"{prefix}.{name}"  # an LM checkpoint loaded into the base model
            return None

        for t in targets:
            found = direct(t.name)
            if found is not None:
                self.source[t.name] = found
        for group in naming.ties:  # a tied name the checkpoint leaves out reads its partner
            found = next((self.source[n] for n in group if n in self.source), None)
            if found is None:
                found = next((direct(n) for n in group if direct(n) is not None), None)
            if found is not None:
                for n in group:
                    self.source.setdefault(n, found)
        problems = []
        missing = [t.name for t in targets if t.name not in self.source
                   and not any(p.search(t.name) for p in naming.ignore_missing)]
        if missing and strict:
            problems.append(f"{len(missing)} tensor(s) of the model are not in the checkpoint: {_names(missing)}")
        elif missing:
            logger.warning("pretrained: %d tensor(s) of the model are not in %s and keep their values: %s",
                           len(missing), where, _names(missing))
        used = set(self.source.values())
        if gather_names:  # a pipeline rank holds some names only: what any rank reads is used
            used = set().union(*_all_gather(sorted(used)))
        unexpected = [n for n in entries if n not in used and not any(p.search(n) for p in naming.ignore_unexpected)]
        if unexpected and strict:
            files = sorted({entries[n].file for n in unexpected})
            problems.insert(0, f"{len(unexpected)} tensor(s) in the checkpoint are not in the model: "
                               f"{_names(unexpected)} (in {', '.join(files[:3])}{' ...' if len(files) > 3 else ''})")
        elif unexpected:
            logger.warning("pretrained: %d tensor(s) of %s are not in the model and are not read: %s",
                           len(unexpected), where, _names(unexpected))
        shapes = []
        for t in targets:
            name = self.source.get(t.name)
            if name is not None and tuple(entries[name].shape) != tuple(t.full_shape):
                shapes.append(f"shape mismatch for {t.name!r}: the checkpoint has {_shape(entries[name].shape)} "
                              f"(tensor {name!r} in {entries[name].file}), the model {_shape(t.full_shape)}"
                              f"{t.shard_note()}")
        problems += _capped(shapes, "shape mismatches")
        self.problem = None
        if problems:
            self.problem = f"pretrained: {where} does not fit {what}; nothing loaded:\n  " + "\n  ".join(problems)


# ------------------------------------------------------------------------------------------------ reading
def _read(targets: Sequence[_Target], source: Dict[str, str], entries: Dict[str, _Entry]) -> Tuple[int, int]:
    """Copy every target's local slices from the files; returns (tensors, bytes read).

    A tensor held under several names (tied) is read once; which slices each holds is
    :func:`local_regions` of the tensor and its ``ShardSpec``.
    """
    from .distributed.dtensor_params import is_dtensor
    from .progress import Progress

    done: set = set()
    count, nbytes = 0, 0
    todo = [t for t in targets if t.name in source]
    shown = Progress("loading pretrained weights", total=len(todo), unit="tensor") if _rank() == 0 else None
    with torch.no_grad(), (shown or contextlib.nullcontext()):
        for t in todo:
            if shown is not None:
                shown.update(note=t.name)
            local = t.tensor.to_local() if is_dtensor(t.tensor) else t.tensor
            # known by its memory: a state dict that detaches its values gives a tied tensor under two objects
            memory = (local.data_ptr(), tuple(local.shape), local.stride())
            if memory in done:
                continue
            done.add(memory)
            entry = entries[source[t.name]]
            regions = local_regions(t.tensor, t.spec)
            # one open per tensor: safetensors maps the file, and closing it releases the pages this read touched
            with _safe_open(entry.file) as handle:
                if not entry.shape:  # a scalar: nothing to slice
                    piece = handle.get_tensor(entry.name)
                    local.copy_(piece)
                    nbytes += piece.numel() * piece.element_size()
                elif regions:
                    lazy = handle.get_slice(entry.name)
                    for local_index, global_index in regions:
                        piece = lazy[global_index]
                        local[local_index].copy_(_on_device_of(piece, local))  # converts to the model's dtype
                        nbytes += piece.numel() * piece.element_size()
            count += 1
    return count, nbytes


def _on_device_of(piece: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``piece`` (read from a file, on the CPU) moved to ``target``'s device in its own dtype. A host-to-device
    ``copy_`` that also changes the dtype converts on the CPU, element by element, before the transfer (a bf16
    checkpoint into fp32 parameters: about 0.4 GB/s in a profile of a TP=2 LLaMA-1.1B load on an H200 host); moved first, the conversion runs
    on the device, and the transfer carries the file's narrower dtype."""
    if target.device.type == "cpu" or piece.dtype == target.dtype:
        return piece
    return piece.to(target.device)


# ------------------------------------------------------------------------------------------------ public
class PretrainedWeights:
    """A safetensors checkpoint checked against a model, ready to load (used by :func:`schedlang.build`).

    ``for_build`` checks the names and unsharded shapes of an unbuilt (meta) model before anything
    is allocated; ``materialize`` allocates its meta tensors empty at their sharded size (initializing
    only the tensors the checkpoint lacks); ``load`` reads every rank's slices into the built model.
    """

    def __init__(self, entries: Dict[str, _Entry], where: str, init_weights: Any = None, strict: bool = True):
        self.entries = entries
        self.where = where
        self.init_weights = init_weights
        self.strict = strict
        self.covered: set = set()  # ids of the unbuilt model's tensors that the checkpoint holds
        self.naming: Optional[_Naming] = None  # of the unsplit model

    @classmethod
    def open(cls, source, **kw) -> "PretrainedWeights":
        """Read the headers of ``source`` on every rank (collective: a rank that cannot raises on all)."""
        problem, entries, where = None, {}, str(source)
        try:
            entries, where = read_index(source)
        except CheckpointError as e:
            problem = str(e)
        _agree(problem)
        return cls(entries, where, **kw)

    @classmethod
    def for_build(cls, model: nn.Module, source, init_weights: Any = None,
                  dtype: Optional[torch.dtype] = None) -> "PretrainedWeights":
        """Check ``source`` against the model ``build`` is about to materialize (collective); see the class."""
        weights = cls.open(source, init_weights=init_weights)
        targets = _meta_targets(model)
        weights.naming = _Naming.of(model, targets)
        plan = _Plan(type(model).__name__, targets, weights.naming, weights.entries, weights.where, strict=True,
                     gather_names=False)
        _agree(plan.problem)
        weights.covered = {id(t.tensor) for t in targets if t.name in plan.source}
        if dtype is not None:
            _cast_meta(model, dtype)
        return weights

    def materialize(self, model: nn.Module, device: torch.device) -> None:
        """Allocate the meta tensors empty on ``device``; initialize only those the checkpoint does not hold."""
        from .init import has_meta_tensors

        if has_meta_tensors(model):
            self.materializer(model, device).run(model)

    def materializer(self, model: nn.Module, device: torch.device):
        """The :class:`~schedlang.materialize.Materializer` of :meth:`materialize`, to run now or (a pipeline
        rank) once the split names the tensors the rank keeps."""
        from .materialize import DEFAULT_INIT, Materializer, default_inits

        init = self.init_weights
        needing = [m for m in model.modules()
                   if any(t is not None and t.is_meta and id(t) not in self.covered
                          for t in list(m._parameters.values()) + list(m._buffers.values()))]
        inits: Dict[int, Any] = {}
        if init is not False and needing:
            defaults = {} if callable(init) else default_inits(model)
            for module in needing:
                inits[id(module)] = init if callable(init) else defaults.get(id(module))
        return Materializer(device, DEFAULT_INIT, inits)

    def load(self, model: nn.Module) -> Dict[str, Any]:
        """Read this rank's slices into ``model`` (built: DTensors or plain local shards, FSDP2, pipeline stages);
        collective."""
        started = time.perf_counter()
        targets, states = _built_targets(model)
        naming = _Naming.of(model, targets).merged(self.naming)
        plan = _Plan(type(model).__name__, targets, naming, self.entries, self.where, strict=self.strict,
                     gather_names=True)
        _agree(plan.problem)
        problem, count, nbytes = None, 0, 0
        try:
            count, nbytes = _read(targets, plan.source, self.entries)
        except CheckpointError as e:
            problem = str(e)
        except Exception as e:  # a file changed or broke since its header was read
            problem = f"pretrained: reading {self.where} failed: {type(e).__name__}: {e}"
        _agree(problem)
        if states:  # the slices went into state dicts that may hold copies: write them into the modules
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            for stage, state in states:
                set_model_state_dict(stage, state, options=StateDictOptions(strict=False))
        seconds = time.perf_counter() - started
        logger.info("loaded %d tensors (%.1f MiB of slices) from %s in %.2f s", count, nbytes / 2**20, self.where,
                    seconds)
        return {"tensors": count, "bytes_read": nbytes, "seconds": seconds, "source": self.where}


def _cast_meta(model: nn.Module, dtype: torch.dtype) -> None:
    """Give the meta (not yet allocated) floating-point tensors ``dtype``, so that they are allocated in it."""
    memo: Dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(store.items()):
                if t is None or not t.is_meta or not t.is_floating_point() or t.dtype == dtype:
                    continue
                if id(t) not in memo:
                    data = t.detach().to(dtype)
                    memo[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data
                store[name] = memo[id(t)]


def load_pretrained(model: nn.Module, source: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
                    strict: bool = True) -> Dict[str, Any]:
    """Load HF safetensors weights into a built model, each rank reading only the slices it holds.

    ``model`` is what :func:`schedlang.build` returned (tensor parallel as DTensors or as plain local
    shards, FSDP2, pipeline stages, one process) or any module. ``source``: a checkpoint directory (``model.safetensors`` or sharded files
    with ``model.safetensors.index.json``), a ``.safetensors`` file or a list of files. Every rank must
    call it. Names and shapes are checked on every rank first (see :mod:`schedlang.pretrained`);
    with ``strict=False`` names present on one side only are skipped with a warning (shapes must still
    match). Returns ``{"tensors", "bytes_read", "seconds", "source"}`` (this rank's tensors and bytes).

    Example::

        schedlang.export_hf(model, "out/ft")              # under one layout
        schedlang.load_pretrained(other_model, "out/ft")  # under another
    """
    return PretrainedWeights.open(source, strict=strict).load(model)

"""Where two models part ways: module outputs recorded by forward hooks, matched by module path.

A :class:`ModuleRecorder` keeps a copy of every module's output, call by call, in the order the
calls finish. Comparing the scheduled model's record with the original's gives the first
module, in execution order, whose output diverges. Outputs recorded again while gradients are
computed are recomputations (activation checkpointing); they must reproduce the forward.

:func:`attention_hint` explains the commonest cause of a divergence inside attention after
tensor parallelism: a head count attribute that still holds the global value while the
q / k / v projections hold only this rank's heads.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .compare import compare_tensors

__all__ = ["ModuleRecorder", "first_divergence", "attention_hint", "split_input_hint", "flatten_outputs"]

_HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "num_kv_heads",
                    "n_kv_heads")
_KV_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_Q_NAMES = ("q_proj", "q", "query", "wq", "q_lin")
_K_NAMES = ("k_proj", "k", "key", "wk", "k_lin")
_V_NAMES = ("v_proj", "v", "value", "wv", "v_lin")


def flatten_outputs(value: Any, prefix: str, out: List[Tuple[str, torch.Tensor]]) -> None:
    """Append ``(name, tensor)`` for every tensor in a nested output (tuples, lists, dicts, HF outputs)."""
    if isinstance(value, torch.Tensor):
        out.append((prefix, value))
    elif isinstance(value, dict):
        for k, v in value.items():
            flatten_outputs(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            flatten_outputs(v, f"{prefix}[{i}]", out)


def _snapshot(output: Any) -> List[torch.Tensor]:
    found: List[Tuple[str, torch.Tensor]] = []
    flatten_outputs(output, "", found)
    tensors = []
    for _, t in found:
        local = getattr(t, "to_local", None)
        tensors.append((local() if callable(local) else t).detach().clone())
    return tensors


class ModuleRecorder:
    """Forward hooks on every submodule of ``model`` that keep a copy of each output.

    ``forward[path]`` lists the outputs of each call made while ``recomputing`` is False,
    ``recomputed[path]`` those made while it is True (set it around ``backward()``);
    ``order`` lists ``(path, call index)`` of the forward calls in the order they finished.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.forward: Dict[str, List[List[torch.Tensor]]] = {}
        self.recomputed: Dict[str, List[List[torch.Tensor]]] = {}
        self.order: List[Tuple[str, int]] = []
        self.recomputing = False
        self.types: Dict[str, str] = {}
        self._handles = []

    def __enter__(self) -> "ModuleRecorder":
        for path, module in self.model.named_modules():
            if not path:
                continue  # the whole model's output is compared on its own
            if isinstance(module, torch.jit.ScriptModule):
                continue  # a TorchScript-fused subgraph takes no hooks; its output is compared where it is used
            self.types[path] = type(module).__name__
            self._handles.append(module.register_forward_hook(self._hook(path)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, path: str):
        def record(module, args, output):
            if self.recomputing:
                self.recomputed.setdefault(path, []).append(_snapshot(output))
            else:
                calls = self.forward.setdefault(path, [])
                self.order.append((path, len(calls)))
                calls.append(_snapshot(output))

        return record

    def recompute_mismatches(self, tol_for) -> List[str]:
        """Messages for recomputed outputs that match none of the forward calls of their module."""
        messages = []
        for path, calls in self.recomputed.items():
            originals = self.forward.get(path, [])
            for again in calls:
                if any(_same(again, first, tol_for) for first in originals):
                    continue
                detail = ""
                if originals and len(originals[0]) == len(again):
                    for a, b in zip(again, originals[0]):
                        msg = compare_tensors("output", a, b, tol_for(b.dtype))
                        if msg:
                            detail = f": {msg}"
                            break
                messages.append(f"recomputed module '{path}' ({self.types.get(path, '?')}) does not reproduce its "
                                f"forward output when activation checkpointing recomputes it in backward{detail}")
                break
        return messages


def _same(a: List[torch.Tensor], b: List[torch.Tensor], tol_for) -> bool:
    if len(a) != len(b):
        return False
    return all(x.shape == y.shape and compare_tensors("", x, y, tol_for(y.dtype)) is None for x, y in zip(a, b))


def _shapes(tensors: List[torch.Tensor]) -> str:
    return ", ".join(str(tuple(t.shape)) for t in tensors) or "no tensors"


def first_divergence(scheduled: ModuleRecorder, reference: ModuleRecorder, tol_for) -> Optional[Dict[str, Any]]:
    """The first module (in the order the scheduled model's calls finished) whose output has the
    shape of the original's and differs from it; None if every comparable output agrees.

    Returns ``{"path", "type", "message", "shapes", "split_before"}``. Modules whose outputs have
    another shape than the original's (this rank's shard of a split activation) cannot be compared
    and are passed over; ``split_before`` is the last of them before the divergence, with its
    shapes (a reshape of a split activation that assumes the full size goes wrong right after it)."""
    split_before = None
    for path, call in scheduled.order:
        ref_calls = reference.forward.get(path)
        if not ref_calls or call >= len(ref_calls):
            continue
        mine, theirs = scheduled.forward[path][call], ref_calls[call]
        if len(mine) != len(theirs) or any(a.shape != b.shape for a, b in zip(mine, theirs)):
            split_before = (path, scheduled.types.get(path, "?"), _shapes(mine), _shapes(theirs))
            continue
        for i, (a, b) in enumerate(zip(mine, theirs)):
            msg = compare_tensors(f"output {i}" if len(mine) > 1 else "output", a, b, tol_for(b.dtype))
            if msg:
                return {"path": path, "type": scheduled.types.get(path, "?"), "message": msg,
                        "shapes": (_shapes(mine), _shapes(theirs)), "split_before": split_before}
    return None


def split_input_hint(found: Dict[str, Any]) -> Optional[str]:
    """A hint when the diverging module runs right after a module whose output is split on this rank."""
    split = found.get("split_before")
    if split is None:
        return None
    path, kind, ours, theirs = split
    return (f"'{found['path']}' runs after '{path}' ({kind}), whose output is this rank's part ({ours} here, "
            f"{theirs} in the original): a reshape or view in between that assumes the full size (a head count, a "
            f"hidden size) reads the split activation wrongly")


def _out_features(module: nn.Module) -> Optional[int]:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    if isinstance(module, nn.Linear):
        return int(weight.shape[0])
    if hasattr(module, "nf"):  # HF Conv1D stores (in, out)
        return int(weight.shape[1])
    return None


def _child(module: nn.Module, names) -> Optional[Tuple[str, nn.Module]]:
    for name in names:
        child = module._modules.get(name)
        if child is not None and _out_features(child) is not None:
            return name, child
    return None


def _attention_hint_for(path: str, module: nn.Module, original: Optional[nn.Module]) -> Optional[str]:
    q = _child(module, _Q_NAMES)
    if q is None:
        return None
    kv = _child(module, _K_NAMES) or _child(module, _V_NAMES)
    for attr in _HEAD_ATTRIBUTES:
        heads = getattr(module, attr, None)
        if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0:
            continue
        proj = kv if attr in _KV_ATTRIBUTES and kv is not None else q
        local = _out_features(proj[1])
        original_proj = None if original is None else original._modules.get(proj[0])
        full = _out_features(original_proj) if original_proj is not None else None
        original_heads = getattr(original, attr, heads) if original is not None else heads
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int) or head_dim <= 0:
            head_dim = (full // original_heads) if full and isinstance(original_heads, int) and original_heads else None
        if head_dim is None or local is None or local % head_dim:
            continue
        local_heads = local // head_dim
        if local_heads != heads:
            return (f"attention '{path}' ({type(module).__name__}) reads {attr}={heads} but its projections hold "
                    f"{local_heads} heads per rank ('{proj[0]}' has {local} output features, head_dim={head_dim}"
                    f"{'' if full is None else f', {full} in the original'}); set {attr} to the local head count "
                    f"when sharding it")
    return None


def attention_hint(scheduled: nn.Module, reference: nn.Module, path: Optional[str]) -> Optional[str]:
    """A hint if ``path`` or one of its ancestors is an attention whose head count disagrees with its
    sharded q / k / v projections; failing that (or with ``path`` None), the first such attention of
    the model."""
    modules = dict(scheduled.named_modules())
    ref_modules = dict(reference.named_modules())
    parts = path.split(".") if path else []
    candidates = [".".join(parts[:depth]) for depth in range(len(parts), -1, -1)] if path is not None else []
    candidates += [p for p in modules if p not in candidates]
    for at in candidates:
        module = modules.get(at)
        if module is None:
            continue
        hint = _attention_hint_for(at or "<root>", module, ref_modules.get(at))
        if hint:
            return hint
    return None

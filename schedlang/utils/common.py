"""Hooks, module kinds and optional imports, under Slapo's names.

Hook kinds are named as in ``Schedule.sync``: ``fwd_pre`` (forward pre-hooks), ``fwd_post``
(forward hooks) and ``bwd_post`` (full backward hooks).
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from functools import lru_cache
from types import FunctionType
from typing import Any, Dict, Iterable, List, Optional

from torch import fx, nn

from ..errors import ScheduleValueError

__all__ = ["get_hooks", "has_hook", "transfer_hooks", "transfer_hooks_for_fusion", "transfor_param_tags",
           "is_lambda_function", "is_module_list", "importlib_or_none", "HOOK_TYPE_TO_ATTR"]

HOOK_TYPE_TO_ATTR = {"fwd_pre": "_forward_pre_hooks", "fwd_post": "_forward_hooks", "bwd_post": "_backward_hooks"}


def _check_kinds(kinds: Iterable[str], where: str) -> List[str]:
    kinds = list(kinds)
    for kind in kinds:
        if kind not in HOOK_TYPE_TO_ATTR:
            raise ScheduleValueError(f"{where}: unknown hook kind {kind!r}: valid are {', '.join(HOOK_TYPE_TO_ATTR)}")
    return kinds


def get_hooks(mod: nn.Module) -> Dict[str, list]:
    """The module's hooks by kind: ``{"fwd_pre": [...], "fwd_post": [...], "bwd_post": [...]}``."""
    return {kind: list(getattr(mod, attr).values()) for kind, attr in HOOK_TYPE_TO_ATTR.items()}


def has_hook(mod: nn.Module, hook_type: str) -> bool:
    """Whether ``mod`` has a hook of kind ``hook_type``."""
    _check_kinds([hook_type], "has_hook")
    return len(getattr(mod, HOOK_TYPE_TO_ATTR[hook_type])) > 0


def transfer_hooks(old_mod: nn.Module, new_mod: nn.Module, hook_types: Optional[Iterable[str]] = None) -> None:
    """Move ``old_mod``'s hooks of the given kinds (all by default) onto ``new_mod``, after its own.

    The hook dictionaries are copied, not shared, so removing a hook from one module later does
    not remove it from the other. Keyword-taking forward hooks keep their flags.
    """
    kinds = _check_kinds(HOOK_TYPE_TO_ATTR if hook_types is None else hook_types, "transfer_hooks")
    for kind in kinds:
        attr = HOOK_TYPE_TO_ATTR[kind]
        merged = OrderedDict(getattr(new_mod, attr))
        merged.update(getattr(old_mod, attr))
        setattr(new_mod, attr, merged)
        for flags in ("_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
            if kind != "bwd_post" and hasattr(old_mod, flags):
                getattr(new_mod, flags).update(getattr(old_mod, flags))
    if "bwd_post" in kinds and old_mod._backward_hooks:
        new_mod._is_full_backward_hook = old_mod._is_full_backward_hook


def _module_at(sch, target: str) -> nn.Module:
    return sch.mod.get_submodule(target)


def transfer_hooks_for_fusion(sch, subgraphs: List[List[Any]], new_mod: nn.Module) -> None:
    """Give ``new_mod`` (the fusion of ``subgraphs`` found in ``sch``) the hooks of the fused modules.

    For one subgraph, the first module's pre-forward and backward hooks and the last module's
    forward hooks move to ``new_mod``; a hook anywhere else cannot be kept and raises. Several
    subgraphs (horizontal fusion) must be free of hooks.
    """
    where = sch.path or "<root>"
    if len(subgraphs) > 1:
        for sub in subgraphs:
            for _, node in sub:
                hooked = node.op == "call_module" and any(has_hook(_module_at(sch, node.target), k)
                                                          for k in HOOK_TYPE_TO_ATTR)
                if hooked:
                    raise ScheduleValueError(f"{where}: cannot fuse {len(subgraphs)} subgraphs horizontally: module "
                                             f"{node.target} has hooks, which a horizontal fusion cannot keep")
        return
    ops = subgraphs[0]
    for i, (_, node) in enumerate(ops):
        if node.op != "call_module":
            continue
        old = _module_at(sch, node.target)
        first, last = i == 0, i == len(ops) - 1
        if first and not last and has_hook(old, "fwd_post"):
            raise ScheduleValueError(f"{where}: cannot fuse: the first module {node.target} has a fwd_post hook, "
                                     "which would run in the middle of the fused module")
        if last and not first and (has_hook(old, "fwd_pre") or has_hook(old, "bwd_post")):
            raise ScheduleValueError(f"{where}: cannot fuse: the last module {node.target} has a fwd_pre or "
                                     "bwd_post hook, which would run in the middle of the fused module")
        if not first and not last and any(has_hook(old, k) for k in HOOK_TYPE_TO_ATTR):
            raise ScheduleValueError(f"{where}: cannot fuse: module {node.target} in the middle of the subgraph "
                                     "has hooks")
        kinds = (["fwd_pre", "bwd_post"] if first else []) + (["fwd_post"] if last else [])
        transfer_hooks(old, new_mod, kinds)


def transfor_param_tags(sch, param, new_param) -> None:
    """Copy the annotations (``Schedule.annotate``) of ``param`` to ``new_param``."""
    for name, value in vars(param).items():
        if not name.startswith("_"):
            setattr(new_param, name, value)


def is_lambda_function(obj: Any) -> bool:
    return isinstance(obj, FunctionType) and obj.__name__ == "<lambda>"


def is_module_list(module: nn.Module, name: str = "", parent=None) -> bool:
    """Whether ``module`` is (or, once traced, was) a list of layers called one by one.

    ``parent`` is the parent's schedule: when both are traced, a parent graph that calls the
    module directly shows it is not a list. Otherwise children named 0, 1, 2 ... make a list.
    """
    if isinstance(module, nn.Sequential):
        return False
    if isinstance(module, nn.ModuleList):
        return True
    if isinstance(module, fx.GraphModule) and parent is not None and isinstance(parent.mod, fx.GraphModule):
        if any(n.op == "call_module" and n.target == name for n in parent.mod.graph.nodes):
            return False
    names = [n for n, _ in module.named_children()]
    return bool(names) and names == [str(i) for i in range(len(names))]


@lru_cache(maxsize=None)
def importlib_or_none(name: str):
    """The module ``name`` if it can be imported, else None (for optional dependencies)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None

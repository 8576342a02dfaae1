"""Per-module-type shard rules.

Sharding a tensor changes a module's shapes; a rule keeps the module consistent
afterwards (a column-parallel ``nn.Linear`` reports its new ``out_features``) and refuses
splits that cannot work. A rule whose module needs another ``forward`` (a row-parallel
linear, a vocabulary-parallel embedding) names the class in ``replacement_class``; the
``shard`` primitive installs a new instance of it in the module's place. One rule per module type, one file each; a rule registers
itself with :func:`register_shard_rule`. Modules without a rule may still be sharded
(the tensor is split and nothing else changes); a log line says so.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple, Type

from torch import nn

__all__ = ["ShardRule", "register_shard_rule", "register_fallback_rule", "find_shard_rule",
           "refuse_bias_of_row_parallel"]

logger = logging.getLogger("schedlang.distributed.shard_rules")

_RULES: Dict[object, Type["ShardRule"]] = {}
# rules for modules of any class, asked in order when no rule is registered for the class itself
_FALLBACKS: List[Type["ShardRule"]] = []


class ShardRule:
    """How sharding a tensor of one module type is checked and how the module is fixed up."""

    #: the module classes this rule applies to (exact classes or subclasses, see ``match_subclasses``)
    module_types: tuple = ()
    #: class names matched when the class cannot be imported here (e.g. transformers' Conv1D)
    module_type_names: tuple = ()
    match_subclasses: bool = False

    @classmethod
    def applies_to(cls, module: nn.Module) -> bool:
        """For fallback rules (:func:`register_fallback_rule`): whether this rule handles ``module``."""
        return False

    @classmethod
    def check(cls, path: str, module: nn.Module, tensor_name: str, axis: int, world_size: int) -> None:
        """Raise :class:`schedlang.ShardError` if the split cannot work. Must not change anything."""

    @classmethod
    def replacement_class(cls, module: nn.Module, tensor_name: str, axis: int, world_size: int,
                          rank: int) -> Optional[type]:
        """The class ``module`` must become now that ``tensor_name`` is its shard (a row-parallel linear
        adds its bias after the all-reduce), or None to keep it. Must not change anything.

        The ``shard`` primitive then puts a new instance of that class in the module's place, holding the
        same parameters, buffers, children, hooks and record (which keeps the original class, for
        ``build``), at every path of the model that held the old one; :meth:`after_shard` and the
        parent's :meth:`after_child_shard` are given the new module. The old module object keeps its
        class, so undoing a failed step only has to put it back."""
        return None

    @classmethod
    def after_shard(cls, module: nn.Module, tensor_name: str, axis: int, world_size: int, rank: int) -> None:
        """Update the module after ``tensor_name`` was replaced by its shard (and the module, if
        :meth:`replacement_class` asked for it, by its replacement: ``module`` is the new one)."""

    @classmethod
    def check_child_shard(cls, path: str, module: nn.Module, child_name: str, child: nn.Module, tensor_name: str,
                          axis: int, world_size: int) -> int:
        """Called on the rule of a *parent* before its child's tensor is sharded (an attention module
        whose head count depends on its projections, say). Raise ShardError to refuse; return the
        number of equal blocks the tensor holds along ``axis`` (GPT-2's fused q|k|v: 3), which are
        then split block-wise so that every rank gets its part of each block."""
        return 1

    @classmethod
    def after_child_shard(cls, module: nn.Module, child_name: str, child: nn.Module, tensor_name: str, axis: int,
                          world_size: int, rank: int) -> None:
        """Update the parent after a child's tensor was sharded (e.g. its local head count)."""


def refuse_bias_of_row_parallel(path: str, kind: str, shards, tensor_name: str, row_axis: int) -> None:
    """The check every Linear-like rule shares: a row-parallel module (its weight split along ``row_axis``, the
    input features) adds its bias once, after the all-reduce, so the bias cannot be split."""
    weight = shards.get("weight")
    if tensor_name == "bias" and weight is not None and weight.axis == row_axis:
        from ...errors import ShardError

        raise ShardError(
            f"{path or '<root>'}: cannot shard 'bias' of a row-parallel {kind} (weight sharded along axis "
            f"{row_axis}): its bias is added once after the all-reduce; keep it whole")


def follow_sharded_weight(module: nn.Module, tensor_name: str, axis: int, size_attributes: Tuple[str, str],
                          row_axis: int, remember: bool = True) -> None:
    """The ``after_shard`` every Linear-like rule shares: once its weight is split, the module's two size
    attributes (``size_attributes``, in the weight's dimension order) follow the weight's new shape, recorded
    first as they were (unless ``remember`` is False: the module's init reads the sizes off the weight); and a
    row-parallel shard (along ``row_axis``) adds the bias after the output syncs."""
    if tensor_name != "weight":
        return
    if remember:
        from ..sharding import remember_unsharded

        remember_unsharded(module, **{name: getattr(module, name) for name in size_attributes})
    for name, size in zip(size_attributes, module.weight.shape):
        setattr(module, name, size)
    if axis == row_axis and getattr(module, "bias", None) is not None:
        from ..sync_ops import run_post_syncs_before_bias

        run_post_syncs_before_bias(module)


def register_shard_rule(rule: Type[ShardRule]) -> Type[ShardRule]:
    for t in rule.module_types:
        _RULES[t] = rule
    for name in rule.module_type_names:
        _RULES[name] = rule
    return rule


def register_fallback_rule(rule: Type[ShardRule], before: Optional[Type[ShardRule]] = None) -> Type[ShardRule]:
    """Register a rule for modules of classes no rule names; it answers ``rule.applies_to(module)``
    (the generic attention / MLP rule, which reads the module's ``forward``). Fallback rules are asked in
    the order they were registered; ``before`` puts this one ahead of another (a narrower rule ahead of the
    generic one, whatever order the files were imported in)."""
    if rule not in _FALLBACKS:
        _FALLBACKS.insert(_FALLBACKS.index(before) if before in _FALLBACKS else len(_FALLBACKS), rule)
    return rule


def find_shard_rule(module: nn.Module) -> Optional[Type[ShardRule]]:
    """The rule for ``module``'s class (or, for rules that allow it, a base class), else the first
    fallback rule that applies to it."""
    _load_rules()
    klass = type(module)
    rule = _RULES.get(klass) or _RULES.get(klass.__name__)
    if rule is not None:
        return rule
    for base in klass.__mro__[1:]:
        rule = _RULES.get(base)
        if rule is not None and rule.match_subclasses:
            return rule
    for rule in _FALLBACKS:
        if rule.applies_to(module):
            return rule
    return None


_LOADED = False


def _load_rules() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")

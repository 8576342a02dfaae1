"""Tuning spaces: :class:`Symbol` (one knob and its candidate values) and :class:`Space` (the knobs,
fixed one after another, where a knob's candidates may depend on the knobs fixed before it).

Example::

    def update_space(args, space):
        bs = space.create_symbol("batch_size", [8, 16, 32])
        space.create_symbol("ckpt_ratio", [0.0, 0.5, 1.0] if bs >= 16 else [0.0])
        return space

    configs = Space().enumerate(update_space, args={})   # 7 configs
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Dict, List, Optional

from ..errors import ScheduleKeyError, ScheduleValueError
from ..logger import get_logger

__all__ = ["must_fix", "Symbol", "Space"]

logger = get_logger("schedlang.autotune")


def must_fix(func):
    """Symbol comparisons are False until the symbol's value is fixed (so that a space can be
    written once and evaluated while its knobs are fixed one by one)."""

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        return self.is_fixed() and func(self, *args, **kwargs)

    return wrapper


class Symbol:
    """A knob ``name`` with candidate values ``vals``; compares by its fixed value."""

    def __init__(self, name: str, vals: List[Any]):
        if not isinstance(vals, (list, tuple)) or not vals:
            raise ScheduleValueError(f"tune: symbol {name!r}: candidate values must be a non-empty list, got {vals!r}")
        self.name, self.vals, self.fixed_idx = name, list(vals), -1

    @property
    def value(self):
        if not self.is_fixed():
            raise ScheduleValueError(f"tune: symbol {self.name!r} has no value yet: fix it first (candidates {self.vals})")
        return self.vals[self.fixed_idx]

    @must_fix
    def __gt__(self, other):
        return self.value > other

    @must_fix
    def __ge__(self, other):
        return self.value >= other

    @must_fix
    def __lt__(self, other):
        return self.value < other

    @must_fix
    def __le__(self, other):
        return self.value <= other

    def __len__(self) -> int:
        return len(self.vals)

    def add(self, val) -> None:
        if val not in self.vals:
            self.vals.append(val)

    def fix_at(self, idx: int) -> None:
        if not 0 <= idx < len(self.vals):
            raise ScheduleValueError(f"tune: symbol {self.name!r} has {len(self.vals)} values; cannot fix it at {idx}")
        self.fixed_idx = idx

    def is_fixed(self) -> bool:
        return self.fixed_idx != -1

    def __repr__(self) -> str:
        return f"Symbol({self.name}={self.value!r})" if self.is_fixed() else f"Symbol({self.name} in {self.vals})"


class Space:
    """Named symbols in creation order; :meth:`enumerate` lists every configuration."""

    def __init__(self):
        self.space: Dict[str, Symbol] = {}
        self.idx_to_name: List[str] = []
        self.fixed_idx = -1

    def create_symbol(self, name: str, vals: List[Any]) -> Symbol:
        """The symbol ``name``: kept if already fixed, else (re)created with ``vals``."""
        if name in self.space and self.space[name].is_fixed():
            return self.space[name]
        if name not in self.space:
            self.idx_to_name.append(name)
        self.space[name] = Symbol(name, vals)
        return self.space[name]

    def __getitem__(self, name: str) -> Symbol:
        if name not in self.space:
            raise ScheduleKeyError(f"tune: space has no symbol {name!r}: symbols are {', '.join(self.idx_to_name)}")
        return self.space[name]

    def next(self) -> Optional[Symbol]:
        """The next symbol to fix, or None when all are."""
        if self.fixed_idx + 1 < len(self.space):
            self.fixed_idx += 1
            return self.space[self.idx_to_name[self.fixed_idx]]
        return None

    def reset(self) -> None:
        self.fixed_idx = -1
        for symbol in self.space.values():
            symbol.fixed_idx = -1

    def to_dict(self) -> Dict[str, Any]:
        return {name: self.space[name].value for name in self.idx_to_name}

    def clone(self) -> "Space":
        return copy.deepcopy(self)

    @staticmethod
    def cfg_dict_to_str(cfg_dict: Dict[str, Any]) -> str:
        return "(" + ", ".join(f"{k}: {v}" for k, v in cfg_dict.items()) + ")"

    def enumerate(self, update_space_fn: Callable[[Any, "Space"], "Space"], args: Any = None) -> List[Dict[str, Any]]:
        """Every configuration: fix the symbols in order, calling ``update_space_fn(args, space)``
        after each choice so later symbols can depend on earlier ones."""
        space = update_space_fn(args, self.clone())
        out: List[Dict[str, Any]] = []

        def walk(space: "Space") -> None:
            symbol = space.next()
            if symbol is None:
                out.append(space.to_dict())
                return
            for idx in range(len(symbol.vals)):
                branch = space.clone()
                branch.space[symbol.name].fix_at(idx)
                walk(update_space_fn(args, branch))

        walk(space)
        return out

    def log_space(self, training_script_args: Any, update_space_fn) -> int:
        """Log every configuration; returns how many there are."""
        configs = self.enumerate(update_space_fn, training_script_args)
        for cfg in configs:
            logger.info("\t%s", self.cfg_dict_to_str(cfg))
        logger.info("space size: %d", len(configs))
        return len(configs)

    def __repr__(self) -> str:
        return "Space(" + ", ".join(repr(s) for s in self.space.values()) + ")"

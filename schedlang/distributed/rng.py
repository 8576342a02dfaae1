"""Per-rank random streams for tensor-parallel regions.

Inside a tensor-parallel region each rank holds different activations (its shard), so
its dropout masks must differ from the other ranks'; outside it, activations are
replicated and masks must agree. A :class:`ForkedRNG` keeps a separate generator state
per device, seeded from ``base_seed + offset + rank``; while a forked module runs, that
state is swapped in for the default one, and the default stream continues afterwards
exactly as if the module had drawn nothing.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

__all__ = ["ForkedRNG", "ForkRngPreHook", "ForkRngPostHook", "FORK_OFFSET"]

#: added to the base seed so that the forked stream never equals the default one
FORK_OFFSET = 2718


class ForkedRNG:
    """Generator states of a forked stream, one per device type, created lazily."""

    def __init__(self, seed: int):
        self.seed = seed
        self._states: Dict[str, torch.Tensor] = {}
        self._saved: list = []

    def _device_key(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"

    def _get_default(self, key: str) -> torch.Tensor:
        return torch.cuda.get_rng_state() if key.startswith("cuda") else torch.get_rng_state()

    def _set_default(self, key: str, state: torch.Tensor) -> None:
        (torch.cuda.set_rng_state if key.startswith("cuda") else torch.set_rng_state)(state)

    def enter(self) -> None:
        key = self._device_key()
        default = self._get_default(key)
        self._saved.append((key, default))
        if key not in self._states:
            gen = torch.Generator(device=key).manual_seed(self.seed)
            self._states[key] = gen.get_state()
        self._set_default(key, self._states[key])

    def exit(self) -> None:
        key, default = self._saved.pop()
        self._states[key] = self._get_default(key)
        self._set_default(key, default)


class ForkRngPreHook:
    def __init__(self, attr: str):
        self.attr = attr

    def __call__(self, module, args):
        getattr(module, self.attr).enter()


class ForkRngPostHook:
    def __init__(self, attr: str):
        self.attr = attr

    def __call__(self, module, args, output):
        getattr(module, self.attr).exit()

"""Per-rank random streams for tensor-parallel regions.

Inside a tensor-parallel region each rank holds different activations (its shard), so
its dropout masks must differ from the other ranks'; outside it, activations are
replicated and masks must agree. A :class:`ForkedRNG` keeps a separate generator state
per device, seeded from ``base_seed + offset + rank``; while a forked module runs, that
state is swapped in for the default one, and the default stream continues afterwards
exactly as if the module had drawn nothing.
"""

from __future__ import annotations

from typing import Dict

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

    @staticmethod
    def _device_keys():
        # fork every generator the module might draw from: the CPU one, and the current GPU's once
        # CUDA is in use (a module on the CPU of a GPU machine draws from the CPU generator)
        keys = ["cpu"]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            keys.append(f"cuda:{torch.cuda.current_device()}")
        return keys

    @staticmethod
    def _get_default(key: str) -> torch.Tensor:
        return torch.cuda.get_rng_state(key) if key.startswith("cuda") else torch.get_rng_state()

    @staticmethod
    def _set_default(key: str, state: torch.Tensor) -> None:
        if key.startswith("cuda"):
            torch.cuda.set_rng_state(state, key)
        else:
            torch.set_rng_state(state)

    def state(self, key: str) -> torch.Tensor:
        """The generator state of device ``key`` (``"cpu"``, ``"cuda:0"``) where the stream stands now."""
        if key not in self._states:
            self._states[key] = torch.Generator(device=key).manual_seed(self.seed).get_state()
        return self._states[key]

    def enter(self) -> None:
        saved = []
        for key in self._device_keys():
            saved.append((key, self._get_default(key)))
            if key not in self._states:
                self._states[key] = torch.Generator(device=key).manual_seed(self.seed).get_state()
            self._set_default(key, self._states[key])
        self._saved.append(saved)

    def exit(self) -> None:
        for key, default in self._saved.pop():
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

"""Verify's random streams: the caller's left as they were, the models' compared and mirrored.

The training pass seeds the default streams and restarts every forked stream (``fork_rng``) from
its seed on both models, so that the original and the scheduled model draw the same masks where
the shapes agree; :func:`rng_state` tells afterwards whether they drew the same numbers.
"""

from __future__ import annotations

import contextlib
from typing import List, Tuple

import torch
from torch import nn

__all__ = ["rng_preserved", "rng_state", "fresh_forked_streams"]

_FORK_ATTRIBUTE = "_schedlang_forked_rng"


@contextlib.contextmanager
def rng_preserved(device: torch.device):
    """Leave the caller's random streams as they were (Verify seeds them for the training pass)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def rng_state(device: torch.device, model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """Where every random stream the model draws from stands: the default ones and each forked one."""
    states = [("default cpu", torch.get_rng_state())]
    if device.type == "cuda":
        states.append(("default cuda", torch.cuda.get_rng_state(device)))
    for path, module in model.named_modules():
        forked = getattr(module, _FORK_ATTRIBUTE, None)
        if forked is not None:
            states += [(f"forked {path} {key}", state.clone()) for key, state in sorted(forked._states.items())]
    return states


def fresh_forked_streams(scheduled: nn.Module, reference: nn.Module) -> List[str]:
    """Restart every forked stream of ``scheduled`` from its seed, and give the module at the same path
    of ``reference`` the same stream, so that both draw the same masks where the shapes agree.
    Returns the forked paths."""
    from ..distributed.rng import ForkedRNG, ForkRngPostHook, ForkRngPreHook

    ref_modules = dict(reference.named_modules())
    paths = []
    for path, module in scheduled.named_modules():
        forked = getattr(module, _FORK_ATTRIBUTE, None)
        if forked is None:
            continue
        paths.append(path or "<root>")
        setattr(module, _FORK_ATTRIBUTE, ForkedRNG(forked.seed))
        twin = ref_modules.get(path)
        if twin is None:
            continue
        if not hasattr(twin, _FORK_ATTRIBUTE):
            twin.register_forward_pre_hook(ForkRngPreHook(_FORK_ATTRIBUTE))
            twin.register_forward_hook(ForkRngPostHook(_FORK_ATTRIBUTE), always_call=True)
        setattr(twin, _FORK_ATTRIBUTE, ForkedRNG(forked.seed))
    return paths

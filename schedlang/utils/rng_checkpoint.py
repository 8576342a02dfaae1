"""Activation checkpointing that keeps the tracker's random streams in step (Slapo's
``slapo.checkpoint``).

Recomputing a block in backward must draw the same random numbers as its forward did, or
dropout masks differ and the gradients are wrong. ``torch.utils.checkpoint`` restores the
default generators; the named streams of :func:`schedlang.random.get_cuda_rng_tracker` (the
tensor-parallel stream) are restored here as well: their states at the start of the forward
are put back for the recomputation, and afterwards the streams continue from where the
forward left them.

Example::

    from schedlang.checkpoint import checkpoint
    out = checkpoint(layer, hidden_states)                      # reentrant, as in Slapo
    out = checkpoint(layer, hidden_states, use_reentrant=False)  # torch's non-reentrant form
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint

from ..errors import ScheduleTypeError

__all__ = ["checkpoint", "CheckpointFunctionWithRNGTracker"]


def _stream_states() -> Dict[str, Dict[str, torch.Tensor]]:
    from ..random import get_cuda_rng_tracker

    from ..distributed.rng import ForkedRNG

    return {name: {k: v.clone() for k, v in stream._states.items()}
            for name, stream in get_cuda_rng_tracker().streams().items() if isinstance(stream, ForkedRNG)}


@contextlib.contextmanager
def _streams_at(saved: Dict[str, Dict[str, torch.Tensor]]) -> Iterator[None]:
    """Run with the tracker's streams as ``saved``; afterwards they are as before the block."""
    from ..random import get_cuda_rng_tracker

    streams = get_cuda_rng_tracker().streams()
    current = {name: dict(streams[name]._states) for name in saved if name in streams}
    for name, states in saved.items():
        if name in streams:
            streams[name]._states = {k: v.clone() for k, v in states.items()}
    try:
        yield
    finally:
        for name, states in current.items():
            streams[name]._states = states


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class CheckpointFunctionWithRNGTracker(torch.autograd.Function):
    """Reentrant checkpointing: ``apply(run_function, *args)`` runs ``run_function(*args)`` without
    keeping activations; backward restores the random state (default generators and tracker
    streams) of the forward, recomputes with gradients, and backpropagates through it."""

    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function = run_function
        ctx.cpu_state = torch.get_rng_state()
        ctx.cuda_state = torch.cuda.get_rng_state() if _cuda_in_use() else None
        ctx.streams = _stream_states()
        ctx.tensor_slots = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[a for a in args if torch.is_tensor(a)])
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint: reentrant checkpointing works with .backward() only, not autograd.grad(); "
                               "use checkpoint(..., use_reentrant=False)")
        args = list(ctx.others)
        for slot, saved in zip(ctx.tensor_slots, ctx.saved_tensors):
            args[slot] = saved.detach().requires_grad_(saved.requires_grad)
        devices = [torch.cuda.current_device()] if ctx.cuda_state is not None else []
        with torch.random.fork_rng(devices=devices), _streams_at(ctx.streams):
            torch.set_rng_state(ctx.cpu_state)
            if ctx.cuda_state is not None:
                torch.cuda.set_rng_state(ctx.cuda_state)
            with torch.enable_grad():
                outputs = ctx.run_function(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if torch.is_tensor(a) else None for a in args)
        return (None,) + input_grads


def checkpoint(function, *args, use_reentrant: bool = True, **kwargs: Any):
    """Checkpoint ``function(*args)``, restoring the tracker's random streams for the recomputation.
    ``use_reentrant=False`` uses ``torch.utils.checkpoint`` (keyword arguments go to it)."""
    if use_reentrant:
        if kwargs:
            raise ScheduleTypeError(f"checkpoint: keyword arguments {sorted(kwargs)} need use_reentrant=False")
        return CheckpointFunctionWithRNGTracker.apply(function, *args)

    def contexts():
        return contextlib.nullcontext(), _streams_at(_stream_states())

    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)

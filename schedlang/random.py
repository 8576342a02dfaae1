"""Random seeds and named random streams (Megatron-style), on every device type.

Tensor-parallel regions need random streams that differ across the ranks of a group (each
rank drops out different elements of its shard), while replicated regions need the same
stream on every rank. :class:`CudaRNGStatesTracker` keeps named streams next to the default
one; ``tracker.fork(name)`` runs a block on a named stream and puts the default stream back
exactly where it was. Despite its (Slapo) name it works on the CPU as well: each stream holds
one generator state per device type in use (the CPU, and the current GPU once CUDA is
initialized), created lazily from the stream's seed (:class:`schedlang.distributed.rng.ForkedRNG`).

``set_random_seed(seed, dp_rank=, pp_rank=, tp_rank=)`` seeds Python, NumPy and torch for this
rank and, with ``tp_rank``, adds the tensor-parallel stream seeded ``seed + 2718 + tp_rank``,
the same seed the ``fork_rng`` primitive uses.

Example::

    schedlang.set_random_seed(1234, tp_rank=tp_rank)
    with get_cuda_rng_tracker().fork():
        out = F.dropout(shard_activations, p=0.1)   # differs across tensor-parallel ranks
"""

from __future__ import annotations

import contextlib
import copy
import random as _py_random
from typing import Any, Dict, Iterator, Optional

import torch

from .distributed.rng import FORK_OFFSET, ForkedRNG
from .errors import ScheduleKeyError, ScheduleTypeError, ScheduleValueError

__all__ = ["CudaRNGStatesTracker", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "is_random_seed_set",
           "set_random_seed", "MODEL_PARALLEL_RNG_TRACKER_NAME"]

#: the stream of tensor-parallel regions
MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_MODEL_PARALLEL_RNG_TRACKER_NAME = MODEL_PARALLEL_RNG_TRACKER_NAME


class CudaRNGStatesTracker:
    """Named random streams, each seeded once; ``fork(name)`` runs a block on one of them."""

    def __init__(self):
        self.states_: Dict[str, Any] = {}
        self.seeds_: set = set()

    def reset(self) -> None:
        """Forget every stream."""
        self.states_ = {}
        self.seeds_ = set()

    def streams(self) -> Dict[str, Any]:
        """The streams by name (a new dictionary holding the same stream objects)."""
        return dict(self.states_)

    def get_states(self) -> Dict[str, Any]:
        """Each stream's generator state, as Megatron's and Slapo's trackers give it: the state tensor of
        the current GPU's generator (the CPU's where there is no GPU), where the stream stands now.
        A value that :meth:`set_states` was given and that is no stream comes back as it was."""
        key = _device_key()
        return {name: stream.state(key) if isinstance(stream, ForkedRNG) else stream
                for name, stream in self.states_.items()}

    def set_states(self, states: Dict[str, Any]) -> None:
        """Replace the streams: a generator state tensor (from :meth:`get_states`) moves the stream of
        that name to it on the current device; a stream object (from :meth:`streams`) is taken as it is."""
        if not isinstance(states, dict):
            raise ScheduleTypeError(f"CudaRNGStatesTracker.set_states: expects a dict of streams by name, got "
                                    f"{type(states).__name__}")
        key = _device_key()
        new: Dict[str, Any] = {}
        for name, value in states.items():
            stream = self.states_.get(name)
            if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
                stream = copy.copy(stream) if isinstance(stream, ForkedRNG) else ForkedRNG(None)
                stream._states = {**stream._states, key: value.clone()}
                stream._saved = []
                new[name] = stream
            else:
                new[name] = value
        self.states_ = new

    def add(self, name: str, seed: int) -> None:
        """Add the stream ``name`` seeded with ``seed``; names and seeds must be new."""
        if seed in self.seeds_:
            raise ScheduleValueError(f"rng_tracker: seed {seed} is already used by another stream; "
                                     f"streams: {', '.join(sorted(self.states_)) or 'none'}; choose another seed")
        if name in self.states_:
            raise ScheduleValueError(f"rng_tracker: a stream named {name!r} already exists; choose another name")
        self.seeds_.add(seed)
        self.states_[name] = ForkedRNG(int(seed))

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block on stream ``name``; afterwards the stream continues where the block left
        it and the default stream is as before the block."""
        stream = self.states_.get(name)
        if stream is None:
            raise ScheduleKeyError(f"rng_tracker: no stream named {name!r} (streams: "
                                   f"{', '.join(sorted(self.states_)) or 'none'}); call "
                                   "schedlang.set_random_seed(seed, tp_rank=...) or tracker.add(name, seed) first")
        if not isinstance(stream, ForkedRNG):
            raise ScheduleTypeError(f"rng_tracker: stream {name!r} holds {type(stream).__name__}, not a stream; only "
                                    "streams made by add() or given a generator state by set_states() can be forked")
        stream.enter()
        try:
            yield
        finally:
            stream.exit()


def _device_key() -> str:
    """The generator ``get_states`` reports: the current GPU's where CUDA is available, else the CPU's."""
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide tracker."""
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int, always_enable_tp_seed: bool = False) -> int:
    """Reset the tracker with the tensor-parallel stream seeded ``seed + 2718 + tp_rank``; the
    default stream is seeded with ``seed`` (or with the tensor-parallel seed too, with
    ``always_enable_tp_seed``, as sequence parallelism wants). Returns the tensor-parallel seed."""
    tp_seed = int(seed) + FORK_OFFSET + int(tp_rank)
    _CUDA_RNG_STATE_TRACKER.reset()
    torch.manual_seed(tp_seed if always_enable_tp_seed else int(seed))
    _CUDA_RNG_STATE_TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME, tp_seed)
    return tp_seed


def is_random_seed_set() -> bool:
    """Whether the tracker holds any stream (``set_random_seed`` with a ``tp_rank`` was called)."""
    return bool(_CUDA_RNG_STATE_TRACKER.get_states())


def set_random_seed(seed: int = 2013, dp_rank: Optional[int] = None, pp_rank: Optional[int] = None,
                    tp_rank: Optional[int] = None, always_enable_tp_seed: bool = False) -> int:
    """Seed Python, NumPy and torch for this rank; returns the seed used.

    Pipeline stages and data-parallel replicas get different seeds (``+ 100 * pp_rank`` and
    ``+ 10 * dp_rank``); the ranks of a tensor-parallel group share one, and with ``tp_rank``
    the tracker gets their per-rank stream (:func:`model_parallel_cuda_manual_seed`).
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ScheduleTypeError(f"set_random_seed: seed must be an int, got {seed!r}")
    if pp_rank is not None:
        seed += 100 * pp_rank
    if dp_rank is not None:
        seed += 10 * dp_rank
    _py_random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:  # NumPy is optional
        pass
    torch.manual_seed(seed)
    if tp_rank is not None:
        model_parallel_cuda_manual_seed(seed, tp_rank, always_enable_tp_seed)
    return seed

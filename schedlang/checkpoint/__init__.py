"""Distributed checkpoints that load under another layout, and export to a HuggingFace directory.

A checkpoint is a directory written by ``torch.distributed.checkpoint`` (DCP): every rank writes
the shards it holds and a ``.metadata`` file records the global shape of every tensor and which
chunk lies where. Loading reads, on every rank, exactly the chunks its own shards cover, so a
checkpoint saved under one layout (tensor parallel, FSDP2, both, pipeline stages, one process)
loads under any other. The optimizer state is kept per parameter *name*
(``torch.distributed.checkpoint.state_dict`` with a flattened optimizer state dict), so AdamW's
``exp_avg`` / ``exp_avg_sq`` / ``step`` reshard with the weights.

Layout of a checkpoint (keys in ``.metadata``)::

    model.<parameter or buffer name>             the model's state dict (original names)
    optim.state.<parameter name>.<state name>    e.g. optim.state.fc1.weight.exp_avg
    optim.param_groups.<parameter name>.<hyperparameter>
    schedlang                                    step, extra and a format version (pickled)

A checkpoint appears at its path only once it is complete: the ranks write into ``<path>.partial``
and rank 0 renames it after all of them finished, with a ``manifest.json`` (every file's size, a
digest of ``.metadata``) that loading checks (:mod:`.commit`). ``AsyncCheckpointer`` does the same
in the background (``torch.distributed.checkpoint.async_save``) while training goes on. A
checkpoint found damaged (a file missing, cut short, unreadable) raises ``CheckpointDamagedError``.

Example::

    model, opt = schedlang.build(sch, optimizer="adamw")          # any layout
    ...
    schedlang.save_checkpoint("ckpt/step-100", model, opt, step=100, extra={"seed": 0})
    # later, maybe on another number of ranks or another layout
    info = schedlang.load_checkpoint("ckpt/step-100", model, opt)  # {"step": 100, "extra": {...}}
    schedlang.export_hf(model, "hf-out")                          # from_pretrained("hf-out") works
"""

import sys
import types

from .async_save import AsyncCheckpointer, PendingCheckpoint
from .dcp import FORMAT_VERSION, load_checkpoint, save_checkpoint
from .hf_export import export_hf
from .ranks import CheckpointDamagedError
from .state import full_tensor

__all__ = ["save_checkpoint", "load_checkpoint", "export_hf", "full_tensor", "CheckpointDamagedError",
           "AsyncCheckpointer", "PendingCheckpoint"]


# Slapo's activation checkpointing names (``slapo.checkpoint.checkpoint``), which keep the
# tensor-parallel random streams in step; they live in schedlang.utils.rng_checkpoint.
def __getattr__(name):
    if name in ("checkpoint", "CheckpointFunctionWithRNGTracker"):
        from ..utils import rng_checkpoint

        return getattr(rng_checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    """``from slapo import checkpoint`` gives Slapo's activation-checkpointing function, where this name is
    the checkpoint package: the package is callable, ``checkpoint(fn, *args)`` runs
    :func:`schedlang.utils.rng_checkpoint.checkpoint`."""

    def __call__(self, function, *args, **kwargs):
        from ..utils import rng_checkpoint

        return rng_checkpoint.checkpoint(function, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

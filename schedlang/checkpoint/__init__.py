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

Example::

    model, opt = schedlang.build(sch, optimizer="adamw")          # any layout
    ...
    schedlang.save_checkpoint("ckpt/step-100", model, opt, step=100, extra={"seed": 0})
    # later, maybe on another number of ranks or another layout
    info = schedlang.load_checkpoint("ckpt/step-100", model, opt)  # {"step": 100, "extra": {...}}
    schedlang.export_hf(model, "hf-out")                          # from_pretrained("hf-out") works
"""

from .dcp import FORMAT_VERSION, load_checkpoint, save_checkpoint
from .hf_export import export_hf
from .ranks import CheckpointDamagedError
from .state import full_tensor

__all__ = ["save_checkpoint", "load_checkpoint", "export_hf", "full_tensor", "CheckpointDamagedError"]


# Slapo's activation checkpointing names (``slapo.checkpoint.checkpoint``), which keep the
# tensor-parallel random streams in step; they live in schedlang.utils.rng_checkpoint.
def __getattr__(name):
    if name in ("checkpoint", "CheckpointFunctionWithRNGTracker"):
        from ..utils import rng_checkpoint

        return getattr(rng_checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""DeepSpeed's pipeline engine over schedlang's stage split (``target="deepspeed"`` with cuts).

The model is built by schedlang, split after its ``cut_pipeline_stage`` modules by
:func:`schedlang.distributed.pipeline.split_model` (each stage a module of the original
objects), and each stage becomes one layer of a ``deepspeed.pipe.PipelineModule`` with one
layer per pipeline stage. DeepSpeed passes one value between layers, so stages exchange tuples.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..registry import register_framework_dialect
from .engine import require_deepspeed

__all__ = ["DeepSpeedPipeStageWrapper", "build_ds_pipeline"]


@register_framework_dialect("deepspeed", "pipeline_stage")
class DeepSpeedPipeStageWrapper(nn.Module):
    """One stage as a DeepSpeed pipeline layer: takes the previous stage's tuple, returns a tuple
    (the last stage: its output tensor)."""

    def __init__(self, stage: nn.Module, stage_id: int, n_stages: int):
        super().__init__()
        self.stage, self.stage_id, self.n_stages = stage, stage_id, n_stages

    def forward(self, inputs):
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        out = self.stage(*args)
        if self.stage_id == self.n_stages - 1:
            return out
        return out if isinstance(out, tuple) else (out,)


@register_framework_dialect("deepspeed", "pipeline_engine")
def build_ds_pipeline(sch, cut_paths: Sequence[str], init_weights: Any = None, config: Any = None,
                      loss_fn=None, topology=None, **kwargs: Any):
    """Build, split and hand the stages to DeepSpeed; returns ``(engine, optimizer)``."""
    deepspeed = require_deepspeed()
    from deepspeed.pipe import PipelineModule

    from ...build import build
    from ...distributed.pipeline import split_model

    model, _ = build(sch, init_weights=init_weights)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    stages = split_model(model, cut_paths, device=device, example_inputs=kwargs.pop("example_inputs", None))
    layers = [DeepSpeedPipeStageWrapper(s, i, len(stages)) for i, s in enumerate(stages)]
    pipe = PipelineModule(layers=layers, num_stages=len(stages), topology=topology, loss_fn=loss_fn,
                          partition_method="uniform")
    params = [p for p in pipe.parameters() if p.requires_grad]
    engine, optimizer, _, _ = deepspeed.initialize(model=pipe, config=config, model_parameters=params, **kwargs)
    return engine, optimizer

"""DeepSpeed's pipeline engine over schedlang's stage split (``target="deepspeed"`` with cuts).

The model is built by schedlang, split after its ``cut_pipeline_stage`` modules by
:func:`schedlang.distributed.pipeline.split_model` (each stage a module of the original
objects), and each stage becomes one layer of a ``deepspeed.pipe.PipelineModule`` with one
layer per pipeline stage. DeepSpeed passes one value between layers, so stages exchange tuples.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Sequence, Tuple

import torch
from torch import nn

from ...errors import ScheduleValueError
from ..registry import register_framework_dialect
from .engine import require_deepspeed

__all__ = ["DeepSpeedPipeStageWrapper", "build_ds_pipeline", "analyze_tie_ranks"]


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


def analyze_tie_ranks(tie_weight_groups: Iterable[Iterable[Tuple[str, int]]],
                      topology: Any) -> Tuple[List[List[List[int]]], List[List[int]]]:
    """The process groups that must sum the gradients of tied weights across pipeline stages.

    ``tie_weight_groups`` holds, per tied weight, its ``(parameter name, stage id)`` places (the
    values of :func:`schedlang.pipeline.analyze_tie_weights` with ``is_pipeline=True``);
    ``topology`` is DeepSpeed's ``PipeModelDataParallelTopology`` (``filter_match(pipe=stage)``
    lists a stage's ranks in a fixed order). Ranks in the same position of every stage hold the
    same slice of the weight, so each position gives one group. Returns ``(ranks, stages)``:
    per tied weight, its groups (each sorted) and its sorted stage ids.

    Example::

        ranks, stages = analyze_tie_ranks(analyze_tie_weights(model, True).values(), topology)
        # pp=4, tp=2, wte on stage 0 tied to the head on stage 3:
        # ranks == [[[0, 6], [1, 7]]], stages == [[0, 3]]
    """
    all_ranks, all_stages = [], []
    for group in tie_weight_groups:
        places = list(group)
        if not places:
            raise ScheduleValueError("analyze_tie_ranks: a tied-weight group is empty; each group must list "
                                     "its (parameter name, stage id) pairs")
        stages = sorted({stage for _, stage in places})
        per_stage = {stage: list(topology.filter_match(pipe=stage)) for stage in stages}
        counts = {stage: len(ranks) for stage, ranks in per_stage.items()}
        if len(set(counts.values())) != 1:
            raise ScheduleValueError(f"analyze_tie_ranks: the stages of tied weight {places[0][0]!r} hold different "
                                     f"numbers of ranks ({counts}); every stage must have as many ranks")
        positions = zip(*(per_stage[stage] for stage in stages))
        all_ranks.append([sorted(ranks) for ranks in positions])
        all_stages.append(stages)
    return all_ranks, all_stages

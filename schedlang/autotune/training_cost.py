"""The cost of one training step of a decoder-only transformer under a layout, and the layout to run.

One import for the pieces: the step's estimate (:mod:`schedlang.autotune.step_cost`: memory per rank,
collectives with their bytes and links, step time), the cluster's links
(:mod:`schedlang.autotune.cluster`), the search over layouts (:mod:`schedlang.autotune.layout_search`) and the
plan as text or JSON (:mod:`schedlang.autotune.estimate_text`). ``bench/train_memory.py`` measures the peak
layout by layout against this estimate; ``bench/validate_planner.py`` compares it with published runs.

Example::

    shape = ModelShape(layers=22, hidden=2048, heads=16, kv_heads=16, head_dim=128, intermediate=5632,
                       vocab=32000, params=1_100_048_384, flops_params=1_034_512_384,
                       embedding_params=131_072_000)
    hw = Hardware.nominal("cuda", memory_gib=141, world=16, gpus_per_node=8)
    choice = choose_layout(shape, hw, world=16, global_batch=32, seq=2048, tp_sizes=[1, 2, 4, 8])
    print(choice.reason)
"""

from __future__ import annotations

from .estimate_text import estimate_json, format_estimate, layout_json
from .layout_search import Choice, RunnerUp, candidate_layouts, choose_layout
from .step_cost import (CHECKPOINT_MODES, DP_MODES, GIB, USABLE_MEMORY, Collective, Hardware, Layout, ModelShape,
                        StepEstimate, data_parallel_bytes, estimate_step, saved_bytes_per_token,
                        selective_recompute_share)

__all__ = ["ModelShape", "Hardware", "Layout", "Collective", "StepEstimate", "Choice", "RunnerUp", "estimate_step",
           "candidate_layouts", "choose_layout", "data_parallel_bytes", "format_estimate", "estimate_json",
           "layout_json", "saved_bytes_per_token", "selective_recompute_share", "GIB", "USABLE_MEMORY",
           "CHECKPOINT_MODES", "DP_MODES"]

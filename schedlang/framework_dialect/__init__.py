"""Running a schedule on another framework's engine (Slapo's ``build(sch, target=...)``).

schedlang runs data, tensor and pipeline parallelism itself (``schedlang.build(sch,
pipeline={...})``). For scripts written against Slapo's DeepSpeed target, ``target="deepspeed"``
still works where DeepSpeed is installed; elsewhere it raises an error pointing at the native
pipeline. :func:`build_with_target` is what ``schedlang.build`` calls when given ``target=`` (this
package registers it with :func:`schedlang.build.register_target_builder` when imported).

Example::

    model, optimizer = schedlang.build(sch, target="deepspeed", config=ds_config)
"""

from __future__ import annotations

from typing import Any, Optional

from ..build import NATIVE_TARGETS, build, register_target_builder
from . import deepspeed, megatron  # noqa: F401  (registers their dialects)
from .deepspeed.utils import DeepSpeedLogParser
from .megatron.utils import MegatronLogParser
from .registry import FrameworkUnavailableError, get_all_dialects, get_dialect_cls, register_framework_dialect

__all__ = ["register_framework_dialect", "get_all_dialects", "get_dialect_cls", "build_with_target",
           "DeepSpeedLogParser", "MegatronLogParser", "FrameworkUnavailableError", "NATIVE_TARGETS"]


def build_with_target(sch, target: Optional[str], init_weights: Any = None, **kwargs: Any):
    """Build ``sch`` for ``target``; returns ``(model, optimizer)`` as ``schedlang.build`` does.

    Native targets build with schedlang itself (``kwargs`` go to ``schedlang.build``). Other
    targets build the model with schedlang, then hand it (split into stages when the plan has
    ``cut_pipeline_stage`` steps) to the target's ``pipeline_engine`` or ``runtime_engine``
    dialect with ``kwargs`` (e.g. DeepSpeed's ``config=``).
    """
    if target in NATIVE_TARGETS:
        return build(sch, init_weights=init_weights, **kwargs)
    get_dialect_cls("runtime_engine", target)  # unknown targets fail before anything is built
    cuts = [step.path for step in sch.plan if step.primitive == "cut_pipeline_stage"]
    if cuts:
        engine = get_dialect_cls("pipeline_engine", target)
        return engine(sch, cuts, init_weights=init_weights, **kwargs)
    model, _ = build(sch, init_weights=init_weights)
    return get_dialect_cls("runtime_engine", target)(model, **kwargs)


register_target_builder(build_with_target)

"""DeepSpeed's engine around a built model (``target="deepspeed"`` without pipeline cuts)."""

from __future__ import annotations

from typing import Any

from ..registry import register_framework_dialect

__all__ = ["init_ds_engine", "require_deepspeed"]

_NATIVE_HINT = ("schedlang runs this natively: cut_pipeline_stage() in the schedule, then "
                "schedlang.build(sch, optimizer=..., pipeline={'schedule': '1F1B', 'n_microbatches': N, "
                "'loss_fn': fn}); data parallelism with sch.fully_shard() / sch.replicate()")


def require_deepspeed():
    """``import deepspeed``, or a clear error saying how to do without it."""
    from ...utils.common import importlib_or_none

    deepspeed = importlib_or_none("deepspeed")
    if deepspeed is None:
        from ..registry import FrameworkUnavailableError

        raise FrameworkUnavailableError(f"build(target='deepspeed'): needs DeepSpeed, which is not installed. "
                                        f"{_NATIVE_HINT}")
    return deepspeed


@register_framework_dialect("deepspeed", "runtime_engine")
def init_ds_engine(model, config: Any = None, **kwargs: Any):
    """``deepspeed.initialize`` over the model's trainable parameters; returns ``(engine, optimizer)``."""
    deepspeed = require_deepspeed()
    params = [p for p in model.parameters() if p.requires_grad]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=params, **kwargs)
    return engine, optimizer

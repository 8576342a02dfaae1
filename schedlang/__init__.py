"""schedlang: a schedule language for optimizing PyTorch models.

Wrap an unchanged ``nn.Module`` in a schedule, say how to run it (shard, sync, replace,
checkpoint, trace, find, fuse ...), check it with ``Verify`` and ``build`` it::

    import schedlang
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[x]):
        sch["mlp.fc1"].shard("weight", axis=0)
        ...
    model, optimizer = schedlang.build(sch, optimizer="adamw", lr=1e-4)
"""

from . import distributed, env, primitives
from .build import build
from .checkpoint import export_hf, load_checkpoint, save_checkpoint
from .errors import (CheckpointError, DistributedError, LoweringError, MissingDependencyError, NotTracedError, PatternError, PipelineError,
                     PlanError, PlanSerializationError, ScheduleKeyError, ScheduleTypeError, ScheduleValueError,
                     SchedlangError, ShardError, SyncError, TraceError, VerificationError)
from .init import init_empty_weights
from .plan import Plan, Step, replay
from .pretrained import load_pretrained
from .primitives.base import list_primitives
from .schedule import Schedule, create_schedule
from .verify import Verify

__version__ = "0.1.0"

from .progress import register_torch_logs as _register_torch_logs  # noqa: E402

_register_torch_logs()  # TORCH_LOGS=+schedlang, as for PyTorch's own components

__all__ = [
    "Schedule", "create_schedule", "Plan", "Step", "replay", "list_primitives", "build", "Verify",
    "init_empty_weights", "call_module", "PH", "distributed", "env", "primitives",
    "SchedlangError", "ScheduleKeyError", "ScheduleValueError", "ScheduleTypeError", "ShardError", "SyncError",
    "PlanError", "PlanSerializationError", "TraceError", "NotTracedError", "PatternError", "LoweringError",
    "VerificationError", "DistributedError", "CheckpointError", "PipelineError", "MissingDependencyError", "save_checkpoint", "load_checkpoint",
    "export_hf", "load_pretrained",
    "__version__",
]


def __getattr__(name):
    # graph helpers and optimizers are imported on first use, so `import schedlang` stays light
    if name == "call_module":
        from .graph.pattern import call_module

        return call_module
    if name == "PH":
        from .graph.tracer import PH

        return PH
    if name in ("optim", "sparse", "lowering", "graph"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'schedlang' has no attribute {name!r}")

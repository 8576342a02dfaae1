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
from . import framework_dialect  # noqa: E402,F401  (registers build(target=...) for other frameworks' engines)
from .captured_step import CapturedStep
from .distributed.agreement import RankFailureError
from .distributed.launch import launch
from .distributed.context_parallel import context_parallel_loss, gather_sequence as gather_context_parallel
from .checkpoint import export_hf, load_checkpoint, save_checkpoint
from .errors import (ArgumentTypeError, CheckpointError, DistributedError, LoweringError, MissingDependencyError,
                     NotTracedError, PatternError, PipelineError, PlanError, PlanMismatchError, PlanSerializationError,
                     ScheduleKeyError, ScheduleTypeError, ScheduleValueError, SchedlangError, ShardError, SyncError,
                     TraceError, VerificationError)
from .initialization import init_empty_weights  # Slapo's signature: (enable=True, include_buffers=False)
from .plan import Plan, Step
from .pretrained import load_pretrained
from .primitives.base import get_primitive, list_primitives, register_primitive
from .replaying import replay
from .schedule import Schedule, create_schedule
from .verify import Verify

__version__ = "0.1.0"

from .progress import register_torch_logs as _register_torch_logs  # noqa: E402

_register_torch_logs()  # TORCH_LOGS=+schedlang, as for PyTorch's own components

__all__ = [
    "Schedule", "create_schedule", "Plan", "Step", "replay", "CapturedStep", "list_primitives", "get_primitive", "register_primitive",
    "build", "Verify", "launch", "context_parallel_loss", "gather_context_parallel",
    "init_empty_weights", "call_module", "PH", "distributed", "env", "primitives",
    "SchedlangError", "ScheduleKeyError", "ScheduleValueError", "ScheduleTypeError", "ShardError", "SyncError",
    "PlanError", "PlanSerializationError", "PlanMismatchError", "ArgumentTypeError", "TraceError", "NotTracedError",
    "PatternError", "LoweringError", "VerificationError", "DistributedError", "CheckpointError", "PipelineError",
    "MissingDependencyError", "RankFailureError", "save_checkpoint", "load_checkpoint",
    "export_hf", "load_pretrained",
    "__version__",
    # Slapo's names and module paths, imported on first use
    "Pattern", "ModulePattern", "get_logger", "set_random_seed", "get_cuda_rng_tracker", "is_random_seed_set",
    "Symbol", "Space", "Database",
]

# Slapo's module paths under schedlang (``import schedlang as slapo; slapo.op.FusedQKV``), loaded on first use
_LAZY_MODULES = ("op", "pattern", "sharding", "random", "pipeline", "utils", "model_schedule",
                 "autotune", "logger", "initialization", "tracer", "version")
# Slapo's top-level names: name -> module that defines it
_LAZY_NAMES = {"Pattern": "pattern", "ModulePattern": "pattern", "get_logger": "logger",
               "set_random_seed": "random", "get_cuda_rng_tracker": "random", "is_random_seed_set": "random",
               "Symbol": "autotune", "Space": "autotune", "Database": "autotune"}


def __getattr__(name):
    # graph helpers and optimizers are imported on first use, so `import schedlang` stays light
    if name == "call_module":
        from .graph.canonical import call_module

        return call_module
    if name == "PH":
        from .graph.tracer import PH

        return PH
    if name in ("optim", "sparse", "lowering", "graph") or name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY_NAMES:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'schedlang' has no attribute {name!r}")

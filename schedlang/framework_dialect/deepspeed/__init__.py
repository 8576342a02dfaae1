"""DeepSpeed as a build target (needs ``deepspeed`` installed): its engine and pipeline engine."""

from . import engine, pipeline, utils  # noqa: F401  (registers the dialects)
from .engine import init_ds_engine
from .utils import DeepSpeedLogParser

__all__ = ["init_ds_engine", "DeepSpeedLogParser"]

"""Megatron-LM training logs, read by the tuner."""

from . import utils  # noqa: F401  (registers the dialect)
from .utils import MegatronLogParser

__all__ = ["MegatronLogParser"]

"""Reading a Megatron-LM training log: time per iteration and memory."""

from __future__ import annotations

from typing import Tuple

from .._log import error_of, last_float
from ..registry import register_framework_dialect

__all__ = ["MegatronLogParser"]


@register_framework_dialect("megatron", "log_parser")
class MegatronLogParser:
    @staticmethod
    def parse_log(log_text: str, global_batch_size: int = 1) -> Tuple[int, float, float, str]:
        """``(error_code, samples_per_sec, memory_gib, error_message)`` from the last iteration line."""
        code, message = error_of(log_text)
        ms = last_float(log_text, r"elapsed time per iteration \(ms\): ([0-9.]+)")
        throughput = global_batch_size * 1000.0 / ms if ms else 0.0
        memory = (last_float(log_text, r"max allocated: ([0-9.]+)") or 0.0) / 1024.0
        return code, throughput, memory, message

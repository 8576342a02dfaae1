"""Reading a DeepSpeed training log: samples per second and memory."""

from __future__ import annotations

from typing import Tuple

from .._log import error_of, last_float
from ..registry import register_framework_dialect

__all__ = ["DeepSpeedLogParser"]


@register_framework_dialect("deepspeed", "log_parser")
class DeepSpeedLogParser:
    @staticmethod
    def parse_log(log_text: str) -> Tuple[int, float, float, str]:
        """``(error_code, samples_per_sec, memory_gib, error_message)``; code 1 is out of memory."""
        code, message = error_of(log_text)
        throughput = last_float(log_text, r"SamplesPerSec=([0-9.]+)") or 0.0
        memory = last_float(log_text, r"(?:MaxMemAllocated|max_mem_allocated)=([0-9.]+)") or 0.0
        return code, throughput, memory, message

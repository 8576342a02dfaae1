"""Memory and speed reports: ``report_memory``, ``profile_perf`` and ``calc_decoder_tflops``.

Everything is logged through :func:`schedlang.logger.get_logger` and returned, never printed.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Sequence

import torch
import torch.distributed as dist

from ..errors import ScheduleValueError
from ..logger import get_logger

__all__ = ["report_memory", "profile_perf", "calc_decoder_tflops", "host_memory_gib"]

logger = get_logger("schedlang.report")


def host_memory_gib() -> float:
    """Resident memory of this process in GiB (``/proc`` on Linux, else the peak from ``resource``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak / (2**30 if sys.platform == "darwin" else 2**20)


def report_memory(msg: str = "", report_gc: bool = False) -> float:
    """Log host memory and, with CUDA, the GPU memory allocated now and the peak since the last call;
    returns the GPU memory allocated now in MiB, as Slapo's does (0.0 without CUDA). ``report_gc`` also
    logs the number of live tensors and their elements.

    Example::

        report_memory("after build")
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    logger.info("%s host memory used: %.4f GiB", msg, host_memory_gib())
    gpu_mib = 0.0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        peak_mib = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        gpu_mib = torch.cuda.memory_allocated(device) / 2**20
        logger.info("%s GPU rank %d memory: %.4f MiB allocated, %.4f MiB peak since the last report", msg, rank,
                    gpu_mib, peak_mib)
    if report_gc:
        gc.collect()
        count = elements = 0
        for obj in gc.get_objects():
            try:
                if torch.is_tensor(obj):
                    numel = obj.numel()
                    if type(numel) is not int:  # a compiler's fake tensor of symbolic shape holds no memory
                        continue
                    count, elements = count + 1, elements + numel
            except Exception:  # objects that fail on inspection are not tensors we can count
                continue
        logger.info("%s live tensors: %d (%d elements)", msg, count, elements)
    return gpu_mib


def profile_perf(model: torch.nn.Module, inputs: Sequence, backward: bool = False, row_limit: int = 100) -> str:
    """Profile one forward (and backward of the output's mean, or of ``output["logits"]``) with
    ``torch.profiler``; logs and returns the table of operators sorted by device (or CPU) time.

    Example::

        table = profile_perf(model, [input_ids], backward=True)
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        with record_function("model_forward"):
            output = model(*inputs)
        if backward:
            with record_function("model_backward"):
                value = output["logits"] if isinstance(output, dict) or hasattr(output, "logits") else output
                if isinstance(value, (tuple, list)):
                    value = value[0]
                value.float().mean().backward()
    sort_by = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=row_limit)
    logger.info("\n%s", table)
    return table


def calc_decoder_tflops(sample_sec: float, num_gpus: int, seq_length: int, num_layers: int, hidden_size: int,
                        vocab_size: int, ckpt_all: bool = False) -> float:
    """Achieved TFLOP/s per device of a GPT-style decoder trained at ``sample_sec`` samples/s.

    Per token and layer, forward + backward of the dense parts cost ``72 h^2`` flops (``24 h^2``
    forward, twice that backward), the attention scores ``12 s h``, and the LM head ``6 V h``
    once per token. With every layer recomputed (``ckpt_all``) a second forward adds a third:
    ``96 h^2`` and ``16 s h``.

    Example::

        calc_decoder_tflops(sample_sec=12.5, num_gpus=8, seq_length=1024, num_layers=24,
                            hidden_size=1024, vocab_size=50257)
    """
    for name, value in (("num_gpus", num_gpus), ("seq_length", seq_length), ("num_layers", num_layers),
                        ("hidden_size", hidden_size)):
        if value <= 0:
            raise ScheduleValueError(f"calc_decoder_tflops: {name} must be positive, got {value}")
    per_layer = 96 if ckpt_all else 72
    per_layer_attention = 16 if ckpt_all else 12
    tokens_per_sec = sample_sec * seq_length
    dense = per_layer * hidden_size**2 * num_layers
    attention = per_layer_attention * seq_length * hidden_size * num_layers
    head = 6 * vocab_size * hidden_size
    return tokens_per_sec * (dense + attention + head) / 1e12 / num_gpus

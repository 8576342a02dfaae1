"""Where Triton kernels run in tests: CUDA tensors when there is a GPU, else CPU under the interpreter."""

import contextlib
import logging
from typing import Iterator, List

import torch


@contextlib.contextmanager
def on_gpu_when_available():
    """Make CUDA torch's default device inside the block when a GPU is present (a no-op otherwise)."""
    if not torch.cuda.is_available():
        yield
        return
    torch.set_default_device("cuda")
    try:
        yield
    finally:
        torch.set_default_device("cpu")


def recorded_cuda_graphs() -> int:
    """How many CUDA graphs torch.compile's cudagraph trees recorded on this process's current GPU (0 when
    none): a compiled layer that silently fell back to launching its kernels one by one records none."""
    from torch._inductor.cudagraph_trees import get_manager

    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    if manager is None:
        return 0
    pending = [node for nodes in manager.roots.values() for node in nodes]
    count = 0
    while pending:
        node = pending.pop()
        count += 1
        pending.extend(child for children in node.children.values() for child in children)
    return count


@contextlib.contextmanager
def cudagraph_skip_messages() -> Iterator[List[str]]:
    """Why torch.compile runs a compiled graph that holds CUDA tensors without CUDA graphs, for every such
    graph compiled inside the block (its ``skipping cudagraphs due to ...`` warnings, and the reason the graph
    carries, with its devices). A graph of CPU tensors alone is not counted: it has nothing to record (torch
    counts it in ``counters["inductor"]["cudagraph_skips"]`` all the same)."""
    from torch._inductor import output_code

    messages: List[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    original = output_code.CompiledFxGraph.post_compile

    def post_compile(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        reason = getattr(self, "disabled_cudagraphs_reason", None)
        if reason and "cuda" in getattr(self, "device_types", ()):
            messages.append(f"graph on {sorted(getattr(self, 'device_types', ()))}: {reason}")
        return result

    logger = logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs")
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    output_code.CompiledFxGraph.post_compile = post_compile
    try:
        yield messages
    finally:
        output_code.CompiledFxGraph.post_compile = original
        logger.removeHandler(handler)

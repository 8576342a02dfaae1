"""torch.compile in tests: compile afresh, so that what a compile-time pass does is seen on every run."""

import contextlib

import torch


@contextlib.contextmanager
def no_compile_caches():
    """Inductor's FX-graph cache and AOT autograd's cache off inside the block: a graph served from either
    skips the compile-time passes (and whatever they count) on the second run of a test."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield

"""Where Triton kernels run in tests: CUDA tensors when there is a GPU, else CPU under the interpreter."""

import contextlib

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

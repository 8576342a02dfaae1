"""Kernel tests run on the GPU when there is one (compiled Triton), else on CPU under the interpreter."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _kernel_device():
    if not torch.cuda.is_available():
        yield
        return
    torch.set_default_device("cuda")
    try:
        yield
    finally:
        torch.set_default_device("cpu")

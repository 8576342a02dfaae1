"""Kernel tests run on the GPU when there is one (compiled Triton), else on CPU under the interpreter."""

import pytest

from tests.helpers.devices import on_gpu_when_available


@pytest.fixture(autouse=True)
def _kernel_device():
    with on_gpu_when_available():
        yield

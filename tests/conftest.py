"""Shared test setup.

Triton kernels run under the numpy interpreter when there is no GPU, so every kernel
is tested on this machine too. The variable must be set before triton is imported.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count()
    for item in items:
        if item.get_closest_marker("gpu") and n_gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        mark = item.get_closest_marker("multigpu")
        if mark is not None and n_gpus < (mark.args[0] if mark.args else 2):
            item.add_marker(pytest.mark.skip(reason=f"needs {mark.args[0] if mark.args else 2} CUDA devices"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield

"""Shared test setup.

Triton kernels run under the numpy interpreter when there is no GPU, so every kernel
is tested on this machine too. The variable must be set before triton is imported.

Markers: ``gpu`` (skipped without a CUDA device) and ``multigpu(n)`` (skipped with fewer than
``n`` devices, default 2). ``ci/gpu.sh`` runs the whole suite on a GPU machine and then these
tests alone. Tests that spawn ranks are bounded by their launcher's own timeout
(:func:`schedlang.distributed.launch.run_distributed`) and by pytest-timeout.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_report_header(config):
    if not config.pluginmanager.hasplugin("timeout"):
        return ["pytest-timeout is not installed: a hung test is not stopped (spawned ranks still are, by their "
                "launcher's timeout)"]
    return None


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count()
    for item in items:
        if item.get_closest_marker("gpu") and n_gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        mark = item.get_closest_marker("multigpu")
        if mark is not None:
            needed = mark.args[0] if mark.args else 2
            if isinstance(needed, bool) or not isinstance(needed, int) or needed < 1:
                raise pytest.UsageError(f"{item.nodeid}: multigpu(n) needs a positive int n, got {needed!r}")
            if n_gpus < needed:
                item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA devices, found {n_gpus}"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _leaves_global_state_as_found(request):
    """Fail the test that changed torch's compiler configs or process defaults, naming what it changed;
    then restore them (and the random generators), so the tests after it are not affected."""
    from tests.helpers.global_state import GlobalState

    before = GlobalState()
    yield
    changes = before.changes()
    before.restore()
    if changes:
        pytest.fail(f"{request.node.nodeid} left process-wide state changed (restore it, e.g. with "
                    f"torch._dynamo.config.patch(...) as a context manager):\n  " + "\n  ".join(changes),
                    pytrace=False)

"""A run that does not ask for float8 shows none of torchao's import noise, and schedlang itself imports torchao
only for float8 (``schedlang.quiet_imports``; transformers imports it whenever it is installed)."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from schedlang import quiet_imports
from schedlang.quiet_imports import quiet_torchao_import

ROOT = Path(__file__).resolve().parents[1]
TORCHAO_MISSING = importlib.util.find_spec("torchao") is None
# torchao's own words for each of its CUDA extensions on a torch built without CUDA
CUDA_EXTENSION_FAILED = ("Failed to load /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-"
                         "linux-gnu.so: Could not load this library: /venv/lib/python3.11/site-packages/torchao/"
                         "_C_mxfp8.cpython-310-x86_64-linux-gnu.so")


class _TorchaoEnum:  # stands for torchao's Enum classes that it registers with pytree
    pass


_TorchaoEnum.__module__ = "torchao.float8.config"


@pytest.fixture
def quieted():
    """The filters installed, and the loggers' filters as they were afterwards (the trainer, run in this process
    by other tests, may have installed them already)."""
    names = ("torchao", "torch.utils._pytree")
    before = {name: list(logging.getLogger(name).filters) for name in names}
    quiet_torchao_import()
    yield
    for name in names:
        logging.getLogger(name).filters[:] = before[name]


def _shown(caplog, name, message, *args):
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        logging.getLogger(name).warning(message, *args)
    return [(r.name, r.levelname) for r in caplog.records]


def test_only_the_known_import_noise_is_dropped_and_it_stays_at_debug(quieted, caplog, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert _shown(caplog, "torchao", CUDA_EXTENSION_FAILED) == [("schedlang.imports", "DEBUG")]
    assert caplog.records[0].getMessage().startswith(f"torchao: {CUDA_EXTENSION_FAILED} (a CUDA extension")
    # torchao's other warnings, and a failure of anything but its own extensions, are shown
    for other in ("Skipping import of cpp extensions due to incompatible torch version. Please upgrade to torch",
                  "Failed to load /venv/lib/python3.11/site-packages/other/_C_ops.so: undefined symbol"):
        assert _shown(caplog, "torchao", other) == [("torchao", "WARNING")], other
    # on a torch built with CUDA, an extension that does not load may be a real mismatch: shown
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert _shown(caplog, "torchao", CUDA_EXTENSION_FAILED) == [("torchao", "WARNING")]

    deprecated = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
                  "Calling register_constant() on Enum subclasses is deprecated")
    assert _shown(caplog, "torch.utils._pytree", deprecated, _TorchaoEnum) == [("schedlang.imports", "DEBUG")]

    class UsersEnum:  # the same warning for anyone else's class is theirs to see
        pass

    assert _shown(caplog, "torch.utils._pytree", deprecated, UsersEnum) == [("torch.utils._pytree", "WARNING")]


def test_installing_twice_adds_each_filter_once(quieted):
    quiet_torchao_import()
    for name, kind in quiet_imports._FILTERS.items():
        assert sum(isinstance(f, kind) for f in logging.getLogger(name).filters) == 1, name


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(TORCHAO_MISSING, reason="torchao is not installed: nothing can import it")
def test_schedlangs_float8_code_imports_torchao_only_when_float8_is_used():
    done = _python(
        "import sys, json\n"
        "import schedlang, schedlang.train, schedlang.cli, schedlang.models.optimize, schedlang.primitives.float8\n"
        "import schedlang.distributed.float8_fsdp, schedlang.graph.passes.shared_amax\n"
        "import schedlang.graph.passes.shared_scaled_mm_operand, schedlang.graph.passes.shared_input_linears\n"
        "before = 'torchao' in sys.modules\n"
        "schedlang.primitives.float8.torchao_float8()\n"
        "print(json.dumps([before, 'torchao.float8' in sys.modules]))\n")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [False, True]


@pytest.mark.skipif(TORCHAO_MISSING, reason="torchao is not installed: it has no import noise to keep out")
@pytest.mark.timeout(600)
def test_a_train_without_float8_shows_no_torchao_noise_and_schedlang_does_not_import_it():
    # every torchao module loaded, with the file whose import statement loaded it: transformers loads torchao
    # whenever it is installed, schedlang must load none of it
    done = _python(
        "import json, sys, traceback\n"
        "loaded_by = []\n"
        "def on_import(event, args):\n"
        "    if event == 'import' and args[0].split('.')[0] == 'torchao':\n"
        "        frames = [f.filename for f in traceback.extract_stack()[:-1] if 'importlib' not in f.filename]\n"
        "        loaded_by.append([args[0], frames[-1]])\n"
        "sys.addaudithook(on_import)\n"
        "from schedlang import train\n"
        "status = train.main(['--model', 'llama', '--config', 'tiny', '--steps', '1', '--device', 'cpu',\n"
        "                     '--global-batch', '2', '--seq', '16'])\n"
        "print(json.dumps({'status': status, 'loaded_by': loaded_by}))\n")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["status"] == 0, done.stderr
    assert "done: steps 1..1" in done.stderr, done.stderr
    for noise in ("Failed to load", "is an Enum subclass"):
        assert noise not in done.stderr, done.stderr
    package = str(ROOT / "schedlang") + "/"
    assert [(module, by) for module, by in result["loaded_by"] if by.startswith(package)] == []

"""Generated kernel source as importable files.

Triton's JIT reads a kernel's source with ``inspect``, and tracebacks show source lines, so
generated kernels are written to a ``.py`` file and imported rather than ``exec``-ed. Each
process writes into its own temporary directory, created on the first kernel and removed when
the interpreter exits (the imported modules stay usable until then; a forked child that
generates kernels gets a directory of its own). Modules are cached by the hash of their text,
so a kernel generated twice is written and imported once.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
from typing import Optional

logger = logging.getLogger("schedlang.lowering.triton")

_MODULE_CACHE: dict[str, object] = {}
_LOCK = threading.Lock()
#: this process's directory of generated sources, and the process that created it
_KERNEL_DIR: Optional[str] = None
_KERNEL_DIR_PID: Optional[int] = None


def _remove_kernel_dir() -> None:
    """At exit: the generated files go (only by the process that made them: a forked child
    inherits this hook and the name but not the directory)."""
    global _KERNEL_DIR
    if _KERNEL_DIR is not None and _KERNEL_DIR_PID == os.getpid():
        shutil.rmtree(_KERNEL_DIR, ignore_errors=True)
        _KERNEL_DIR = None


def kernel_dir() -> str:
    """This process's directory of generated sources, created on first use and removed at exit."""
    global _KERNEL_DIR, _KERNEL_DIR_PID
    if _KERNEL_DIR is None or _KERNEL_DIR_PID != os.getpid():
        first = _KERNEL_DIR_PID is None
        _KERNEL_DIR = tempfile.mkdtemp(prefix="schedlang_kernels_")
        _KERNEL_DIR_PID = os.getpid()
        if first:
            atexit.register(_remove_kernel_dir)
    return _KERNEL_DIR


def load_source(source: str, stem: str):
    """Import generated source from a file (Triton's JIT reads kernel source with ``inspect``)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    with _LOCK:
        module = _MODULE_CACHE.get(digest)
        if module is not None:
            return module
        path = os.path.join(kernel_dir(), f"{stem}_{digest}.py")
        with open(path, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location(f"schedlang_generated.{stem}_{digest}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        _MODULE_CACHE[digest] = module
        logger.debug("loaded generated kernels %s", path)
        return module

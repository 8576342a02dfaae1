"""Keep the log lines of torchao's import that say nothing to the user out of schedlang's commands' output.

transformers imports torchao whenever it is installed (its quantizers load with any model class), so a run
that never asks for float8 imports it too. On a torch built without CUDA that import logs a warning for each
of torchao's CUDA extensions, which cannot load without CUDA's libraries and are not used there, and torch
warns that torchao registers Enum classes with pytree in a way it deprecates. Neither is the user's to act
on. The filters below drop exactly those records (each is still logged at DEBUG under
``schedlang.imports``); every other torchao or pytree record, and the extensions' failures on a torch built
with CUDA (where they may be a real mismatch), pass as before. Loggers exist before the modules that use
them, so the filters are in place before torchao is imported, without importing it.

The library configures no logging: the commands (``schedlang train``, ``schedlang demo`` and their ranks)
install the filters, before they build a model.
"""

from __future__ import annotations

import logging
import re

import torch

logger = logging.getLogger("schedlang.imports")

#: torchao's warning when one of its compiled extensions (``torchao/_C*.so``) fails to load
_EXTENSION_FAILED = re.compile(r"Failed to load \S*[/\\]torchao[/\\]_C\w*[.\w-]*\.so\b")


class _CudaExtensionsWithoutCuda(logging.Filter):
    """torchao's "Failed to load .../torchao/_C*.so" on a torch built without CUDA."""

    def filter(self, record: logging.LogRecord) -> bool:
        if torch.version.cuda is not None or not _EXTENSION_FAILED.match(record.getMessage()):
            return True
        logger.debug("torchao: %s (a CUDA extension; this torch is built without CUDA)", record.getMessage())
        return False


class _TorchaoEnumRegistration(logging.Filter):
    """torch's deprecation warning for an Enum registered as a pytree constant, when torchao's Enum is it."""

    def filter(self, record: logging.LogRecord) -> bool:
        registered = record.args[0] if isinstance(record.args, tuple) and record.args else None
        if not (isinstance(registered, type) and registered.__module__.startswith("torchao")
                and "is an Enum subclass" in str(record.msg)):
            return True
        logger.debug("torch.utils._pytree: %s", record.getMessage())
        return False


_FILTERS = {"torchao": _CudaExtensionsWithoutCuda, "torch.utils._pytree": _TorchaoEnumRegistration}


def quiet_torchao_import() -> None:
    """Install the filters (once per process: a command and each of its ranks call it before building a model)."""
    for name, kind in _FILTERS.items():
        target = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in target.filters):
            target.addFilter(kind())


__all__ = ["quiet_torchao_import"]

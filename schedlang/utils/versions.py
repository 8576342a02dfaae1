"""Version comparisons: ``compare_versions("transformers", ">=", "5.0")``, ``is_torch_version(">=", "2.4")``."""

from __future__ import annotations

import importlib.metadata
import operator
from typing import Union

from packaging.version import Version, parse

from ..errors import ScheduleKeyError, ScheduleValueError

__all__ = ["compare_versions", "is_torch_version", "torch_version"]

_OPERATIONS = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<=": operator.le,
               "<": operator.lt}


def _installed(library: str) -> Version:
    try:
        return parse(importlib.metadata.version(library))
    except importlib.metadata.PackageNotFoundError:
        raise ScheduleKeyError(f"compare_versions: package {library!r} is not installed") from None


torch_version = _installed("torch")


def compare_versions(library_or_version: Union[str, Version], operation: str, requirement_version: str) -> bool:
    """Compare an installed package's version (by name) or a ``Version`` with ``requirement_version``.

    Example::

        compare_versions("torch", ">=", "2.4")   # True with torch 2.13
    """
    if operation not in _OPERATIONS:
        raise ScheduleValueError(f"compare_versions: unknown operation {operation!r}: valid are "
                                 f"{', '.join(_OPERATIONS)}")
    version = _installed(library_or_version) if isinstance(library_or_version, str) else library_or_version
    return _OPERATIONS[operation](version, parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch version, e.g. ``is_torch_version(">=", "2.4")``."""
    return compare_versions(torch_version, operation, version)

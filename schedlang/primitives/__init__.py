"""Schedule primitives, one per file; importing this package registers them all.

Every module in this folder except ``base`` (the registry) and ``params`` (argument
declarations) defines one primitive class decorated with
:func:`~schedlang.primitives.base.register_primitive`.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Primitive, get_primitive, list_primitives, register_primitive

__all__ = ["Primitive", "get_primitive", "list_primitives", "register_primitive"]

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
    if _info.name not in ("base", "params"):
        importlib.import_module(f"{__name__}.{_info.name}")

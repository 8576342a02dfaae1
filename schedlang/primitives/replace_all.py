"""``replace_all(module_type, make_fn)``: replace every submodule of a type.

``make_fn(path, old_module)`` builds each replacement (``path`` relative to this
schedule). All replacements are built and checked before any is put in place, so a
failing ``make_fn`` changes nothing. A match inside a replaced module is not visited.
"""

from __future__ import annotations

import importlib

from torch import nn

from ..errors import ScheduleTypeError, ScheduleValueError
from .base import Primitive, register_primitive


def _matches(root: nn.Module, module_type):
    found, stack = [], [("", root)]
    while stack:
        path, m = stack.pop()
        if path and isinstance(m, module_type):
            found.append(path)
            continue
        for n, c in reversed(list(m.named_children())):
            if not n.startswith("_schedlang_"):
                stack.append((f"{path}.{n}" if path else n, c))
    return found


@register_primitive
class ReplaceAll(Primitive):
    name = "replace_all"

    @classmethod
    def validate(cls, sch, module_type, make_fn):
        where = sch.path or "<root>"
        if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
            raise ScheduleTypeError(f"{where}: replace_all expects an nn.Module subclass as module_type, got "
                                    f"{module_type!r}")
        if not callable(make_fn):
            raise ScheduleTypeError(f"{where}: replace_all expects make_fn(path, old_module) -> nn.Module, got "
                                    f"{type(make_fn).__name__}")
        paths = _matches(sch.mod, module_type)
        if not paths:
            raise ScheduleValueError(f"{where}: no submodule of type {module_type.__name__} to replace")
        new_modules = {}
        for path in paths:
            new = make_fn(path, sch[path].mod)
            if not isinstance(new, nn.Module):
                raise ScheduleTypeError(f"{where}: make_fn returned {type(new).__name__} for '{path}'; it must return "
                                        "an nn.Module")
            new_modules[path] = new
        return {"module_type": module_type, "make_fn": make_fn, "_new_modules": new_modules}

    @classmethod
    def apply(cls, sch, module_type, make_fn, _new_modules):
        for path, new in _new_modules.items():
            sch[path]._set_module(new)
        sch.metadata.setdefault("replaced", []).extend(_new_modules)
        return list(_new_modules)

    @classmethod
    def replay_args(cls, args):
        return {"module_type": args["module_type"], "make_fn": args["make_fn"]}

    @classmethod
    def encode_args(cls, args, step_index, path):
        t = args["module_type"]
        out = {"module_type": f"{t.__module__}:{t.__qualname__}", "make_fn": args["make_fn"]}
        return super().encode_args(out, step_index, path)

    @classmethod
    def decode_args(cls, data):
        mod, _, qual = data["module_type"].partition(":")
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return {"module_type": obj, "make_fn": data["make_fn"]}

    @classmethod
    def describe_args(cls, args):
        return f"module_type={args['module_type'].__name__}, make_fn={getattr(args['make_fn'], '__qualname__', '?')}"

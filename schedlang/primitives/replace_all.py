"""``replace_all(module_type, make_fn, *args, **kwargs)``: replace every submodule of a type.

``make_fn(path, old_module, *args, **kwargs)`` builds each replacement (``path`` relative
to this schedule; the extra arguments are passed on as given). All replacements are built and checked before any is put in place, so a
failing ``make_fn`` changes nothing. A match inside a replaced module is not visited.
"""

from __future__ import annotations

from typing import Any, Callable, Type

from torch import nn

from ..argument_checks import check_arity
from ..errors import SchedlangError, ScheduleTypeError, ScheduleValueError
from .base import Param, Primitive, register_primitive
from .params import FUNCTION, ModuleTypeCodec
from .replace import check_new_module, check_same_calls, users_model_index


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
    """Replace every submodule of type ``module_type`` under this path by ``make_fn(path, old_module)``.

    Example::

        sch.replace_all(nn.GELU, lambda name, old: FastGELU())
    """

    name = "replace_all"
    params = (
        Param("module_type", Type[nn.Module], doc="the type of the submodules to replace", codec=ModuleTypeCodec(),
              type_error="{where}: replace_all expects an nn.Module subclass as module_type, got {value}"),
        Param("make_fn", Callable[..., nn.Module], doc="builds each replacement: ``make_fn(path, old_module, "
              "*make_fn_args, **make_fn_kwargs)``", codec=FUNCTION,
              type_error="{where}: replace_all expects make_fn(path, old_module) -> nn.Module, got {type_name}"),
        Param("make_fn_args", Any, (), "further positional arguments for make_fn", variadic="*"),
        Param("make_fn_kwargs", Any, {}, "keyword arguments for make_fn", variadic="**"),
    )

    @classmethod
    def validate(cls, sch, module_type, make_fn, make_fn_args=(), make_fn_kwargs=None):
        make_fn_args, make_fn_kwargs = tuple(make_fn_args), dict(make_fn_kwargs or {})
        where = sch.path or "<root>"
        extra = f", {len(make_fn_args)} more positional argument(s)" if make_fn_args else ""
        extra += f", keyword argument(s) {', '.join(make_fn_kwargs)}" if make_fn_kwargs else ""
        check_arity(where, "replace_all make_fn", make_fn, f"(path, old_module{extra})",
                    ("path", None, *make_fn_args), make_fn_kwargs)
        paths = _matches(sch.mod, module_type)
        if not paths:
            raise ScheduleValueError(f"{where}: no submodule of type {module_type.__name__} to replace; pass a module type that occurs in the model")
        new_modules = {}
        users_model = users_model_index(sch)
        for path in paths:
            old = sch[path].mod
            try:
                new = make_fn(path, old, *make_fn_args, **make_fn_kwargs)
            except SchedlangError:
                raise
            except Exception as e:
                # the user's function failed: say for which module, so a failure at the 7th of 12 layers is found
                raise ScheduleValueError(f"{where}: replace_all make_fn raised {type(e).__name__} for '{path}' "
                                         f"({type(old).__name__}): {e}; nothing was replaced; fix make_fn so that it "
                                         f"returns an nn.Module for every {module_type.__name__}") from e
            if not isinstance(new, nn.Module):
                raise ScheduleTypeError(f"{where}: make_fn returned {type(new).__name__} for '{path}'; it must return "
                                        "an nn.Module")
            full_path = f"{sch.path}.{path}" if sch.path else path
            if new is not old:
                check_new_module(sch, full_path, new, "replace_all", users_model=users_model)
                check_same_calls(sch, full_path, old, new, "replace_all")
            new_modules[path] = new
        return {"module_type": module_type, "make_fn": make_fn, "make_fn_args": make_fn_args,
                "make_fn_kwargs": make_fn_kwargs, "_new_modules": new_modules}

    @classmethod
    def apply(cls, sch, module_type, make_fn, _new_modules, make_fn_args=(), make_fn_kwargs=None):
        for path, new in _new_modules.items():
            sch[path]._set_module(new)
        sch.metadata.setdefault("replaced", []).extend(_new_modules)
        return list(_new_modules)

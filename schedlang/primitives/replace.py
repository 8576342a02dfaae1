"""``replace(new_mod_or_fn, target_ops=None, name=None, concrete_args=None)``.

Without ``target_ops`` the module at this path is replaced by ``new_mod_or_fn`` (an
``nn.Module``). With ``target_ops`` (subgraphs returned by ``find`` on a traced module),
those subgraphs are replaced by a call to it; several subgraphs at once is horizontal
replacement, the new module returning their outputs in order. ``concrete_args`` gives the
new call further keyword arguments as constants (for parameters the subgraph has no input for).

The module instance you pass is put into the schedule as it is; the plan keeps a copy
taken at call time, so replaying the plan on a fresh model uses the module as it was
when you passed it, not as later steps changed it.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Optional

from torch import nn

from ..errors import ScheduleTypeError, ScheduleValueError
from .base import Param, Primitive, register_primitive
from .params import SUBGRAPHS


def _graph():
    from .. import graph

    return graph


@register_primitive
class Replace(Primitive):
    """Replace this module by ``new_mod_or_fn``, or, with ``target_ops`` (subgraphs from
    :meth:`find`), replace those subgraphs of the traced module by it.

    Example::

        sch["mlp"].replace(FastMLP.from_module(sch["mlp"].mod))
    """

    name = "replace"
    params = (
        Param("new_mod_or_fn", Callable[..., Any], doc="the new module (or, for subgraphs, a function)",
              type_error="{where}: replace expects an nn.Module or a callable, got {type_name}"),
        Param("target_ops", Any, None, "subgraphs found in this traced module (None: the whole module)",
              codec=SUBGRAPHS),
        Param("name", Optional[str], None, "name of the new submodule when replacing subgraphs"),
        Param("concrete_args", Optional[Dict[str, Any]], None,
              "keyword arguments given to the new call as constants, besides the subgraph's inputs"),
    )

    @classmethod
    def validate(cls, sch, new_mod_or_fn, target_ops=None, name=None, concrete_args=None):
        where = sch.path or "<root>"
        if target_ops is not None:
            if concrete_args is not None and not all(isinstance(k, str) and k.isidentifier() for k in concrete_args):
                raise ScheduleValueError(f"{where}: replace concrete_args must map argument names to values, got "
                                         f"keys {sorted(map(repr, concrete_args))}")
            target_ops = _graph().validate_subgraphs(sch, target_ops, "replace")
            return {"new_mod_or_fn": new_mod_or_fn, "target_ops": target_ops, "name": name,
                    "concrete_args": concrete_args}
        if concrete_args is not None:
            raise ScheduleValueError(f"{where}: concrete_args= only applies when replacing subgraphs (target_ops=); "
                                     "a whole-module replacement is called as the old module was")
        if not isinstance(new_mod_or_fn, nn.Module):
            raise ScheduleTypeError(
                f"{where}: replacing a whole module needs an nn.Module instance, got {type(new_mod_or_fn).__name__}; "
                "a function can only replace subgraphs (pass target_ops= from find())")
        if new_mod_or_fn is sch.mod:
            raise ScheduleValueError(f"{where}: the new module is the module already there; pass a different module")
        if name is not None:
            raise ScheduleValueError(f"{where}: name= only applies when replacing subgraphs (target_ops=); "
                                     "a whole-module replacement keeps the path's name")
        return {"new_mod_or_fn": new_mod_or_fn, "target_ops": None, "name": None, "concrete_args": None,
                "_pristine": copy.deepcopy(new_mod_or_fn)}

    @classmethod
    def apply(cls, sch, new_mod_or_fn, target_ops=None, name=None, concrete_args=None, _pristine=None):
        if target_ops is not None:
            return _graph().replace_subgraphs(sch, new_mod_or_fn, target_ops, name, concrete_args)
        sch._set_module(new_mod_or_fn)
        return None

    @classmethod
    def replay_args(cls, args):
        replayed = super().replay_args(args)
        if args.get("_pristine") is not None:  # the module as it was when passed, not as later steps left it
            replayed["new_mod_or_fn"] = copy.deepcopy(args["_pristine"])
        return replayed

"""``replace(new_mod_or_fn, target_ops=None, name=None)``.

Without ``target_ops`` the module at this path is replaced by ``new_mod_or_fn`` (an
``nn.Module``). With ``target_ops`` (subgraphs returned by ``find`` on a traced module),
those subgraphs are replaced by a call to it; several subgraphs at once is horizontal
replacement, the new module returning their outputs in order.

The module instance you pass is put into the schedule as it is; the plan keeps a copy
taken at call time, so replaying the plan on a fresh model uses the module as it was
when you passed it, not as later steps changed it.
"""

from __future__ import annotations

import copy

from torch import nn

from ..errors import ScheduleTypeError, ScheduleValueError
from .base import Primitive, register_primitive


def _graph():
    from .. import graph

    return graph


@register_primitive
class Replace(Primitive):
    name = "replace"

    @classmethod
    def validate(cls, sch, new_mod_or_fn, target_ops=None, name=None):
        where = sch.path or "<root>"
        if target_ops is not None:
            if not (isinstance(new_mod_or_fn, nn.Module) or callable(new_mod_or_fn)):
                raise ScheduleTypeError(f"{where}: replace expects an nn.Module or a callable, got "
                                        f"{type(new_mod_or_fn).__name__}")
            target_ops = _graph().validate_subgraphs(sch, target_ops, "replace")
            return {"new_mod_or_fn": new_mod_or_fn, "target_ops": target_ops, "name": name}
        if not isinstance(new_mod_or_fn, nn.Module):
            raise ScheduleTypeError(
                f"{where}: replacing a whole module needs an nn.Module instance, got {type(new_mod_or_fn).__name__}; "
                "a function can only replace subgraphs (pass target_ops= from find())")
        if new_mod_or_fn is sch.mod:
            raise ScheduleValueError(f"{where}: the new module is the module already there")
        if name is not None:
            raise ScheduleValueError(f"{where}: name= only applies when replacing subgraphs (target_ops=); "
                                     "a whole-module replacement keeps the path's name")
        return {"new_mod_or_fn": new_mod_or_fn, "target_ops": None, "name": None,
                "_pristine": copy.deepcopy(new_mod_or_fn)}

    @classmethod
    def apply(cls, sch, new_mod_or_fn, target_ops=None, name=None, _pristine=None):
        if target_ops is not None:
            return _graph().replace_subgraphs(sch, new_mod_or_fn, target_ops, name)
        sch._set_module(new_mod_or_fn)
        return None

    @classmethod
    def replay_args(cls, args):
        args = dict(args)
        if args.get("target_ops") is not None:
            g = _graph()
            args["target_ops"] = g.decode_subgraphs(g.encode_subgraphs(args["target_ops"]))
        elif args.get("_pristine") is not None:
            args["new_mod_or_fn"] = copy.deepcopy(args["_pristine"])
        args.pop("_pristine", None)
        return args

    @classmethod
    def encode_args(cls, args, step_index, path):
        args = {k: v for k, v in args.items() if k != "_pristine"}
        if args.get("target_ops") is not None:
            args["target_ops"] = _graph().encode_subgraphs(args["target_ops"])
        return super().encode_args(args, step_index, path)

    @classmethod
    def decode_args(cls, data):
        data = dict(data)
        if data.get("target_ops") is not None:
            data["target_ops"] = _graph().decode_subgraphs(data["target_ops"])
        return data

    @classmethod
    def describe_args(cls, args):
        return super().describe_args({k: v for k, v in args.items() if k != "_pristine" and v is not None})

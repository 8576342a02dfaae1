"""``replace(new_mod_or_fn, target_ops=None, name=None, concrete_args=None)``.

Without ``target_ops`` the module at this path is replaced by ``new_mod_or_fn`` (an
``nn.Module``). With ``target_ops`` (subgraphs returned by ``find`` on a traced module),
those subgraphs are replaced by a call to it; several subgraphs at once is horizontal
replacement, the new module returning their outputs in order. ``concrete_args`` gives the
new call further keyword arguments as constants (for parameters the subgraph has no input for).

The module instance you pass is put into the schedule as it is; the plan keeps a copy
taken at call time, so replaying the plan on a fresh model uses the module as it was
when you passed it, not as later steps changed it.

Refused at call time, before anything changes: a class instead of an instance; a module (or
one holding a module or tensor) of the model given to ``create_schedule``, which later steps
would then change; a module that encloses the path, which would then contain itself; and, for
a whole module, one whose ``forward`` cannot take any call the old ``forward`` takes.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import nn

from ..errors import ScheduleTypeError, ScheduleValueError
from .base import Param, Primitive, register_primitive
from .params import SUBGRAPHS


def _graph():
    from .. import graph

    return graph


def _enclosing_modules(sch, path: str) -> List[nn.Module]:
    """The modules of the schedule's model that hold the one at ``path`` (from the root), that one excluded."""
    modules = [sch.root.mod]
    parts = path.split(".") if path else []
    for k in range(1, len(parts)):
        modules.append(modules[-1]._modules[parts[k - 1]])
    return modules if parts else []


def users_model_index(sch) -> Tuple[Dict[int, str], Dict[int, str]]:
    """The modules and tensors of the model given to ``create_schedule``, by ``id``, with their paths."""
    original = sch._state.original
    if original is None:
        return {}, {}
    modules = {id(m): n for n, m in original.named_modules(remove_duplicate=False)}
    tensors = {id(t): n for n, t in itertools.chain(original.named_parameters(remove_duplicate=False),
                                                    original.named_buffers(remove_duplicate=False))}
    return modules, tensors


def check_new_module(sch, path: str, new: nn.Module, primitive: str, becomes_child: bool = False,
                     users_model: Optional[Tuple[Dict[int, str], Dict[int, str]]] = None) -> None:
    """Refuse a module that cannot be put at ``path`` (relative to the root) of the schedule's model.

    * Part of the model given to ``create_schedule``, or holding one of its tensors: later steps (shard,
      sync, checkpoint) and training would change the user's model through it, which a schedule never does.
    * One of the modules that will hold it (an ancestor of ``path``; with ``becomes_child`` the module at
      ``path`` too, as for a subgraph's replacement): the model would contain itself, and forward would never end.
    """
    where = sch.path or "<root>"
    user_modules, user_tensors = users_model if users_model is not None else users_model_index(sch)
    if user_modules:
        for name, m in new.named_modules():
            if id(m) in user_modules:
                inner = f" (its submodule '{name}')" if name else ""
                raise ScheduleValueError(
                    f"{where}: {primitive} got a {type(new).__name__}{inner} that is the module at "
                    f"'{user_modules[id(m)] or '<root>'}' of the model given to create_schedule; the schedule works on a "
                    f"copy and must never change your model: pass sch['{user_modules[id(m)]}'].mod (the schedule's "
                    f"copy) or copy.deepcopy(...) of it")
        for name, t in itertools.chain(new.named_parameters(), new.named_buffers()):
            if id(t) in user_tensors:
                raise ScheduleValueError(
                    f"{where}: {primitive} got a {type(new).__name__} whose tensor '{name}' is '{user_tensors[id(t)]}' "
                    f"of the model given to create_schedule; training the schedule would change your model: build "
                    f"the new module from the schedule's copy (sch[...].mod) or from cloned tensors")
    holders = _enclosing_modules(sch, path)
    if becomes_child:
        holders.append(sch.root[path].mod if path else sch.root.mod)
    for name, m in new.named_modules():
        for holder_path, holder in zip([""] + [".".join(path.split(".")[:k]) for k in range(1, len(holders))],
                                       holders):
            if m is holder:
                inner = f"its submodule '{name}' is" if name else "it is"
                raise ScheduleValueError(
                    f"{where}: {primitive} cannot put this {type(new).__name__} at '{path or '<root>'}': {inner} the "
                    f"module at '{holder_path or '<root>'}', which would then contain itself; pass a new module, or "
                    f"copy.deepcopy(...) of that one")


def _forward_parameters(module: nn.Module) -> Optional[List[inspect.Parameter]]:
    """The parameters of the class's ``forward`` without ``self`` (what the model's calls bind to), or None
    when it has no readable signature."""
    try:
        params = list(inspect.signature(inspect.unwrap(type(module).forward)).parameters.values())
    except (TypeError, ValueError):
        return None
    return params[1:]


def _call_form(params: List[inspect.Parameter]) -> str:
    shown = []
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not any(q.kind is q.VAR_POSITIONAL for q in params) and "*" not in shown:
            shown.append("*")
        prefix = "*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else ""
        shown.append(prefix + p.name + ("" if p.default is p.empty else "=..."))
    return f"({', '.join(shown)})"


def _never_callable_as(old: List[inspect.Parameter], new: List[inspect.Parameter]) -> str:
    """Why no call that ``old``'s forward accepts can bind to ``new``'s (``""`` when some call can).

    Only what fails for every call is refused: a required argument of the new forward that the old one
    cannot be given at all, or a required argument of the old forward that the new one cannot take either
    by position or by name. Whether the model's own calls fit beyond that shows at the first forward.
    """
    def shape(params):
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        by_name = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        return (positional, by_name, any(p.kind is p.VAR_POSITIONAL for p in params),
                any(p.kind is p.VAR_KEYWORD for p in params))

    old_positional, old_names, old_star, old_star_star = shape(old)
    new_positional, new_names, new_star, new_star_star = shape(new)
    for index, p in enumerate(new_positional):
        if p.default is not p.empty:
            continue
        fits = old_star or index < len(old_positional) or (
            p.kind is p.POSITIONAL_OR_KEYWORD and (old_star_star or p.name in old_names))
        if not fits:
            return f"it needs '{p.name}', which the old forward is never given"
    for p in new:
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty and not (old_star_star or p.name in old_names):
            return f"it needs the keyword argument '{p.name}', which the old forward is never given"
    for index, p in enumerate(old_positional):
        if p.default is not p.empty:
            continue
        by_position = new_star or index < len(new_positional)
        by_name = p.kind is p.POSITIONAL_OR_KEYWORD and (new_star_star or p.name in new_names)
        if not (by_position or by_name):
            return f"every call gives '{p.name}', which it cannot take"
    for p in old:
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty and not (new_star_star or p.name in new_names):
            return f"every call gives the keyword argument '{p.name}', which it cannot take"
    return ""


def check_same_calls(sch, path: str, old: nn.Module, new: nn.Module, primitive: str) -> None:
    """Refuse a replacement whose ``forward`` cannot take any call the replaced module's ``forward`` takes: the
    model would fail at its first forward, far from the step that caused it."""
    old_params, new_params = _forward_parameters(old), _forward_parameters(new)
    if old_params is None or new_params is None:
        return
    reason = _never_callable_as(old_params, new_params)
    if reason:
        raise ScheduleValueError(
            f"{sch.path or '<root>'}: {primitive} cannot put {type(new).__name__} at '{path or '<root>'}': its "
            f"forward{_call_form(new_params)} cannot be called as the {type(old).__name__} there is, "
            f"forward{_call_form(old_params)}: {reason}; pass a module whose forward takes the same arguments")


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
        if isinstance(new_mod_or_fn, type):
            # a class is callable, but calling it makes a module, not the replacement's output
            raise ScheduleTypeError(f"{where}: replace got the class {new_mod_or_fn.__name__}, not an instance; pass "
                                    f"{new_mod_or_fn.__name__}(...) (an nn.Module instance) or a function")
        if isinstance(new_mod_or_fn, nn.Module):
            check_new_module(sch, sch.path, new_mod_or_fn, "replace", becomes_child=target_ops is not None)
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
        check_same_calls(sch, sch.path, sch.mod, new_mod_or_fn, "replace")
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

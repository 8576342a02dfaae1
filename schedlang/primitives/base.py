"""The primitive registry and the base class every primitive derives from.

A primitive is one kind of schedule step (``shard``, ``sync``, ``trace`` ...). Each lives
in its own file as a subclass of :class:`Primitive` decorated with
:func:`register_primitive`. It declares its arguments once, as a tuple of
:class:`~schedlang.primitives.params.Param` (name, type, default, description, JSON
codec), and writes two methods:

* :meth:`Primitive.validate` checks the arguments against the schedule (after their
  declared types were checked) and returns them normalized, changing nothing;
* :meth:`Primitive.apply` changes the schedule's working module as the step says.

Everything else comes from the declaration: the type check, the plan's JSON
(:meth:`Primitive.encode_args` / :meth:`Primitive.decode_args`), the arguments of an
in-process replay, the printed plan, and the signature and docstring of the
``Schedule`` method (:meth:`Primitive.signature`, :meth:`Primitive.method_doc`).
Argument names starting with ``_`` in what ``validate`` returns are values prepared for
``apply`` (a copy of a module, a traced pattern): they stay in the step but are never
written, printed or replayed.

This module imports nothing of the schedule or the plan: they import it.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar, Dict, List, Tuple, Type

from ..errors import ArgumentTypeError, ScheduleKeyError
from .params import DecodeContext, Param, check_type, format_type, short_repr

__all__ = ["Primitive", "Param", "register_primitive", "get_primitive", "list_primitives", "signature_mismatch",
           "install_in_place_of"]

_REGISTRY: Dict[str, Type["Primitive"]] = {}


def _private(key: str) -> bool:
    return key.startswith("_")


def _fits(value: Any, p: Param) -> bool:
    # None where the default is None means "not given", whatever the declared type
    return (value is None and p.default is None) or check_type(value, p.type)


class Primitive:
    """One kind of schedule step. Subclasses are never instantiated; all methods are classmethods.

    The class docstring is the user-facing description (it becomes the ``Schedule`` method's
    docstring, followed by the declared arguments).
    """

    #: the name users call it by (``sch.<name>(...)``) and that plans record
    name: ClassVar[str] = ""
    #: the declared arguments, in call order; options (``Param(option=True)``) come last
    params: ClassVar[Tuple[Param, ...]] = ()
    #: whether a call is recorded as a step of the plan (False for queries such as ``find``)
    records_step: ClassVar[bool] = True
    #: raised for an unknown, missing or wrongly typed argument
    argument_error: ClassVar[Type[Exception]] = ArgumentTypeError

    # ------------------------------------------------------------------ written by each primitive
    @classmethod
    def validate(cls, sch: Any, **args: Any) -> Dict[str, Any]:
        """Check the (type-checked) arguments against ``sch`` and return them normalized.

        Must raise a :class:`schedlang.SchedlangError` subclass on bad input and must not
        change anything.
        """
        return dict(args)

    @classmethod
    def apply(cls, sch: Any, **args: Any) -> Any:
        """Change ``sch``'s working module as the step says; return what the method returns."""
        raise NotImplementedError(cls.name)

    # ------------------------------------------------------------------ derived from the declaration
    @classmethod
    def param(cls, name: str) -> Param:
        for p in cls.params:
            if p.name == name:
                return p
        raise KeyError(name)

    @classmethod
    def options(cls) -> List[Param]:
        return [p for p in cls.params if p.option]

    @classmethod
    def bind(cls, sch: Any, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """The call's arguments, defaults filled in (options only when given), type-checked."""
        where = sch.path or "<root>"
        declared = {p.name: p for p in cls.params}
        unknown = [k for k in kwargs if k not in declared]
        if unknown:
            options = cls.options()
            if options:
                raise cls.argument_error(
                    f"{where}: unknown {cls.name} option(s) {', '.join(sorted(unknown))}: valid options are "
                    f"{', '.join(p.name for p in options)}")
            raise cls.argument_error(f"{where}: {cls.name} takes no argument(s) {', '.join(sorted(unknown))}; its "
                                    f"arguments are {', '.join(declared) or 'none'}")
        args: Dict[str, Any] = {}
        for p in cls.params:
            if p.name in kwargs:
                value = kwargs[p.name]
            elif p.option:
                continue
            elif p.required:
                raise cls.argument_error(f"{where}: {cls.name} needs the argument '{p.name}' ({p.doc or p.name})")
            else:
                value = p.default
            if not _fits(value, p):
                raise cls.argument_error(p.type_message(where, cls.name, value))
            args[p.name] = value
        return args

    @classmethod
    def _where(cls, step_index: int, path: str) -> str:
        return f"step {step_index} ({cls.name} at '{path or '<root>'}')"

    @classmethod
    def encode_args(cls, args: Dict[str, Any], step_index: int, path: str) -> Dict[str, Any]:
        """The step's arguments as JSON data (PlanSerializationError for values that have none)."""
        declared = {p.name: p for p in cls.params}
        out = {}
        for key, value in args.items():
            if _private(key):
                continue
            where = f"{cls._where(step_index, path)}, argument '{key}'"
            out[key] = declared[key].codec.encode(value, where) if value is not None else None
        return out

    @classmethod
    def decode_args(cls, data: Any, ctx: DecodeContext) -> Dict[str, Any]:
        """Inverse of :meth:`encode_args`; every problem is a PlanSerializationError naming the step."""
        if not isinstance(data, dict):
            raise ctx.error(f"\"args\" must be a JSON object of argument names to values, got {data!r}")
        declared = {p.name: p for p in cls.params}
        unknown = [k for k in data if k not in declared]
        if unknown:
            raise ctx.error(f"{cls.name} has no argument(s) {', '.join(map(repr, sorted(unknown)))}; its arguments "
                            f"are {', '.join(declared) or 'none'}")
        args: Dict[str, Any] = {}
        for p in cls.params:
            if p.name not in data:
                if p.required:
                    raise ctx.error(f"missing argument '{p.name}' ({p.doc or p.name})")
                continue
            arg_ctx = DecodeContext(ctx.step_index, ctx.primitive, ctx.path, p.name, ctx.trusted_modules)
            raw = data[p.name]
            value = None if raw is None else p.codec.decode(raw, arg_ctx)
            if not _fits(value, p):
                raise arg_ctx.error(f"must be {p.expected()}, got {short_repr(value)}")
            args[p.name] = value
        return args

    @classmethod
    def replay_args(cls, args: Dict[str, Any]) -> Dict[str, Any]:
        """Arguments for running the step again on a fresh model in this process.

        Values pointing into the working copy (graph nodes, say) are looked up again; prepared
        ``_`` values are dropped (``validate`` prepares them anew).
        """
        declared = {p.name: p for p in cls.params}
        return {k: (declared[k].codec.for_replay(v) if v is not None else None)
                for k, v in args.items() if not _private(k)}

    @classmethod
    def describe_args(cls, args: Dict[str, Any]) -> str:
        """Short human-readable form of the arguments for ``str(plan)`` (unset optional ones left out)."""
        declared = {p.name: p for p in cls.params}
        shown = []
        for key, value in args.items():
            if _private(key) or (value is None and declared[key].default is None):
                continue
            shown.append(f"{key}={declared[key].codec.describe(value)}")
        return ", ".join(shown)

    @classmethod
    def signature(cls) -> inspect.Signature:
        """The ``Schedule`` method's signature (with ``self``), as the declaration says."""
        P = inspect.Parameter
        params = [P("self", P.POSITIONAL_OR_KEYWORD)]
        for p in cls.params:
            if p.variadic:
                params.append(P(p.name, P.VAR_POSITIONAL if p.variadic == "*" else P.VAR_KEYWORD,
                                annotation=p.type))
            elif not p.option:
                params.append(P(p.name, P.POSITIONAL_OR_KEYWORD, annotation=p.type,
                                default=P.empty if p.required else p.default))
        if cls.options():
            params.append(P("options", P.VAR_KEYWORD, annotation=Any))
        return inspect.Signature(params)

    @classmethod
    def method_doc(cls) -> str:
        """The ``Schedule`` method's docstring: the primitive's description, then its arguments."""
        text = inspect.cleandoc(cls.__doc__ or "")
        lines = [text] if text else []
        main = [p for p in cls.params if not p.option]
        if main:
            lines += ["", "Args:"] + [f"    {p.doc_line()}" for p in main]
        if cls.options():
            lines += ["", "Keyword options (``**options``, recorded only when given):", ""]
            lines += [f"* ``{p.name}`` ({format_type(p.type)}): {p.doc}" for p in cls.options()]
        return "\n".join(lines)


def signature_mismatch(fn: Any, primitive: Type[Primitive]) -> str:
    """How the signature of ``fn`` (a ``Schedule`` method) differs from ``primitive``'s declaration
    (``""`` when they agree): names, order, defaults and annotations; ``**options`` iff it has options."""
    import typing

    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # an annotation that does not evaluate is a mismatch too
        return f"its annotations do not evaluate ({e})"
    actual = list(inspect.signature(fn).parameters.values())[1:]
    expected = list(primitive.signature().parameters.values())[1:]
    if [(p.name if p.kind is not p.VAR_KEYWORD else "**") for p in actual] != \
            [(p.name if p.kind is not p.VAR_KEYWORD else "**") for p in expected]:
        return (f"arguments ({', '.join(str(p) for p in actual)}) instead of "
                f"({', '.join(str(p) for p in expected)})")
    for a, e in zip(actual, expected):
        if a.kind is not e.kind:
            return f"'{a.name}' is {a.kind.description}, declared {e.kind.description}"
        if e.kind is e.VAR_KEYWORD or e.kind is e.VAR_POSITIONAL:
            if e.kind is e.VAR_POSITIONAL and a.name != e.name:
                return f"'*{a.name}' instead of '*{e.name}'"
            continue
        if a.default != e.default:
            return f"'{a.name}' defaults to {a.default!r}, declared {e.default!r}"
        if hints.get(a.name, inspect.Parameter.empty) != e.annotation:
            return f"'{a.name}' is annotated {hints.get(a.name)!r}, declared {e.annotation!r}"
    return ""


def register_primitive(cls: Type[Primitive]) -> Type[Primitive]:
    """Class decorator: make ``cls`` callable as ``Schedule.<cls.name>`` and replayable."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no primitive name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"primitive '{cls.name}' is registered twice ({_REGISTRY[cls.name].__qualname__}, {cls.__qualname__})")
    names = [p.name for p in cls.params]
    if len(set(names)) != len(names) or any(n.startswith("_") for n in names):
        raise ValueError(f"{cls.__qualname__}: argument names must be unique and public, got {names}")
    if any(p.variadic == "**" for p in cls.params) and cls.options():
        raise ValueError(f"{cls.__qualname__}: a '**' argument and keyword options cannot go together")
    if any(p.variadic not in ("", "*", "**") for p in cls.params):
        raise ValueError(f"{cls.__qualname__}: variadic must be '', '*' or '**'")
    seen_option = False
    for p in cls.params:
        if seen_option and not p.option:
            raise ValueError(f"{cls.__qualname__}: '{p.name}' follows an option; options come last")
        seen_option = seen_option or p.option
    _REGISTRY[cls.name] = cls
    return cls


def get_primitive(name: str) -> Type[Primitive]:
    """The primitive class registered as ``name``."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ScheduleKeyError(
            f"primitives: unknown primitive {name!r}: registered primitives are {', '.join(sorted(_REGISTRY))}"
        ) from None


def list_primitives() -> List[str]:
    """Names of all registered primitives, sorted."""
    return sorted(_REGISTRY)


def install_in_place_of(sch, old, new) -> None:
    """Put module ``new`` wherever the schedule's model holds ``old``: the root, or any child slot (a module
    may sit at several paths). ``old`` is left as it was (its class too), so undoing the step only has to
    restore the holders' child tables and, for the root, the schedule's module. Primitives that change what
    a module is (``decompose``, a shard whose rule needs another class) install the new one this way."""
    root = sch.root
    if root.mod is old:
        root._set_module(new)
    for parent in list(root.mod.modules()):
        for child_name, child in list(parent._modules.items()):
            if child is old:
                parent._modules[child_name] = new

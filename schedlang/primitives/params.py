"""Typed argument declarations for primitives, and how their values are written to plans.

A primitive declares each argument once, as a :class:`Param`: name, type, default, a
one-line description and a :class:`Codec` (how the value is written to plan JSON, read
back, reused for an in-process replay and shown in ``str(plan)``). From that one
declaration come the type check at call time and when a plan is read, the plan's JSON,
the printed plan, and the ``Schedule`` method's documented signature.

Example::

    params = (
        Param("tensor_name", str, doc="parameter or buffer to split"),
        Param("axis", int, doc="dimension to split along"),
    )
"""

from __future__ import annotations

import collections.abc
import dataclasses
import importlib
import inspect
import sys
import typing
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from torch import nn

from ..errors import PlanSerializationError

__all__ = ["Param", "Codec", "REQUIRED", "PLAIN", "FUNCTION", "SUBGRAPHS", "ModuleTypeCodec", "DecodeContext",
           "check_type", "describe_type", "format_type", "encode_value", "short_repr"]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: marks an argument without a default
REQUIRED: Any = _Required()


# ----------------------------------------------------------------------------------------- types

def _origin(tp: Any) -> Any:
    return typing.get_origin(tp)


def _is_sequence_origin(origin: Any) -> bool:
    return origin in (list, tuple, collections.abc.Sequence)


def check_type(value: Any, tp: Any) -> bool:
    """Whether ``value`` fits the annotation ``tp`` (the subset of typing that primitives use).

    ``bool`` is not an ``int`` here, and a string is not a list of strings.
    """
    if tp is Any:
        return True
    if tp is None or tp is type(None):
        return value is None
    origin = _origin(tp)
    if origin is Union:
        return any(check_type(value, t) for t in typing.get_args(tp))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is collections.abc.Callable or origin is collections.abc.Callable:
        return callable(value)
    if origin is type:
        (base,) = typing.get_args(tp) or (object,)
        return isinstance(value, type) and issubclass(value, base)
    if _is_sequence_origin(origin) or tp in (list, tuple, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            return False
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return not args or all(check_type(v, args[0]) for v in value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            return False
        args = typing.get_args(tp)
        return not args or all(check_type(k, args[0]) and check_type(v, args[1]) for k, v in value.items())
    if isinstance(tp, type):
        return isinstance(value, tp)
    raise TypeError(f"unsupported argument type {tp!r} in a primitive declaration")


_NOUNS = {bool: "bools", int: "ints", float: "numbers", str: "strings"}


def _article(word: str) -> str:
    return f"an {word}" if word[:1].lower() in "aeiou" or word.startswith("nn.") else f"a {word}"


def _class_name(cls: type) -> str:
    return f"nn.{cls.__name__}" if cls.__module__.startswith("torch.nn") else cls.__name__


def describe_type(tp: Any) -> str:
    """``tp`` in words, for messages: ``Optional[int]`` -> ``"None or an int"``."""
    if tp is Any:
        return "any value"
    if tp is None or tp is type(None):
        return "None"
    origin = _origin(tp)
    if origin is Union:
        words = [describe_type(t) for t in typing.get_args(tp)]
        words.sort(key=lambda w: w != "None")  # None first, as users write Optional
        return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]
    if tp is bool:
        return "True or False"
    if tp is int:
        return "an int"
    if tp is float:
        return "a number"
    if tp is str:
        return "a str"
    if tp is collections.abc.Callable or origin is collections.abc.Callable:
        return "a callable"
    if origin is type:
        (base,) = typing.get_args(tp) or (object,)
        return _article(f"{_class_name(base)} subclass")
    if _is_sequence_origin(origin) or tp in (list, tuple, collections.abc.Sequence):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        if not args or args[0] is Any:
            return "a list"
        return f"a list of {_NOUNS.get(args[0]) or describe_type(args[0])}"
    if origin is dict or tp is dict:
        return "a dict"
    if isinstance(tp, type):
        return _article(_class_name(tp))
    return repr(tp)


def format_type(tp: Any) -> str:
    """``tp`` as it reads in a signature (for docs)."""
    if isinstance(tp, type) and _origin(tp) is None:
        return _class_name(tp) if tp.__module__ != "builtins" else tp.__name__
    args = typing.get_args(tp)
    if _origin(tp) is Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return f"Optional[{format_type(rest[0] if len(rest) == 1 else Union[tuple(rest)])}]"
    return inspect.formatannotation(tp).replace("torch.nn.modules.module.Module", "nn.Module")


# ---------------------------------------------------------------------------------- plain values

def short_repr(value: Any, limit: int = 60) -> str:
    """A short readable form of an argument value, for the printed plan and messages."""
    if isinstance(value, nn.Module):
        text = f"<{type(value).__name__}>"
    elif isinstance(value, type):
        text = value.__name__
    elif callable(value) and hasattr(value, "__qualname__"):
        text = f"<{getattr(value, '__module__', '?')}.{value.__qualname__}>"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def encode_value(value: Any, where: str) -> Any:
    """Return ``value`` as JSON data, or raise PlanSerializationError saying what cannot be written."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [encode_value(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: encode_value(v, where) for k, v in value.items()}
    raise PlanSerializationError(
        f"plan: {where} is a Python object ({type(value).__name__}: {short_repr(value)}) and cannot be "
        "serialized to JSON; replay such a plan in the same process with schedlang.replay(plan, model), "
        "or pass plain values (numbers, strings, lists)"
    )


# -------------------------------------------------------------------------------------- decoding

@dataclasses.dataclass
class DecodeContext:
    """Where in a plan a value is being read, and which modules its type names may come from."""

    step_index: int
    primitive: str
    path: str
    argument: str = ""
    trusted_modules: Tuple[str, ...] = ()

    @property
    def where(self) -> str:
        text = f"step {self.step_index} ({self.primitive} at '{self.path or '<root>'}')"
        return f"{text}, argument '{self.argument}'" if self.argument else text

    def error(self, message: str) -> PlanSerializationError:
        return PlanSerializationError(f"{self.where}: {message}")

    def _trusted(self, module_name: str) -> bool:
        return any(module_name == t or module_name.startswith(t + ".") for t in self.trusted_modules)

    def resolve_class(self, module_name: str, qualname: str, base: type = nn.Module) -> type:
        """The class ``module_name.qualname``, from a module already imported or a trusted one.

        Reading a plan never imports a module it merely names: that would run whatever code
        the file points at.
        """
        full = f"{module_name}.{qualname}"
        if not module_name or not qualname or not all(p.isidentifier() for p in qualname.split(".")):
            raise self.error(f"{full!r} is not a class name (expected 'package.module.Class')")
        if module_name not in sys.modules:
            if not self._trusted(module_name):
                raise self.error(
                    f"the plan names type '{full}' from module '{module_name}', which is not imported; a plan never "
                    f"imports modules by itself: import it before replaying, or pass "
                    f"trusted_modules=['{module_name}'] to schedlang.replay")
            try:
                importlib.import_module(module_name)
            except ImportError as e:
                raise self.error(f"cannot import trusted module '{module_name}' for type '{full}': {e}") from e
        obj: Any = sys.modules[module_name]
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                raise self.error(f"module '{module_name}' has no '{qualname}' (type '{full}' named in the plan)")
        if not (isinstance(obj, type) and issubclass(obj, base)):
            raise self.error(f"'{full}' is not {_article(_class_name(base) + ' subclass')} "
                             f"(it is {type(obj).__name__})")
        return obj

    def resolve_dotted(self, name: str, base: type = nn.Module) -> type:
        """Like :meth:`resolve_class` for ``"package.module.Class"`` written without a ``:``."""
        if not isinstance(name, str) or "." not in name:
            raise self.error(f"expected a class name like 'package.module.Class', got {name!r}")
        parts = name.split(".")
        for k in range(len(parts) - 1, 0, -1):  # the longest module prefix that holds the class
            module_name = ".".join(parts[:k])
            if module_name in sys.modules or self._trusted(module_name):
                try:
                    return self.resolve_class(module_name, ".".join(parts[k:]), base)
                except PlanSerializationError:
                    continue
        return self.resolve_class(".".join(parts[:-1]), parts[-1], base)  # raises, naming the likely module


# ---------------------------------------------------------------------------------------- codecs

class Codec:
    """How one argument's value travels through a plan. The base class handles plain data."""

    def encode(self, value: Any, where: str) -> Any:
        """JSON data for ``value``; PlanSerializationError (naming ``where``) if there is none."""
        return encode_value(value, where)

    def decode(self, data: Any, ctx: DecodeContext) -> Any:
        """The value written by :meth:`encode` (raise ``ctx.error(...)`` on malformed data)."""
        return data

    def for_replay(self, value: Any) -> Any:
        """The value to pass when the step runs again on a fresh model in this process."""
        return value

    def describe(self, value: Any) -> str:
        """Short form for ``str(plan)``."""
        return short_repr(value)


class _FunctionCodec(Codec):
    def describe(self, value: Any) -> str:
        return getattr(value, "__qualname__", None) or short_repr(value)


class ModuleTypeCodec(Codec):
    """An ``nn.Module`` subclass, written as ``"package.module:Qualname"``."""

    def encode(self, value: Any, where: str) -> Any:
        return f"{value.__module__}:{value.__qualname__}"

    def decode(self, data: Any, ctx: DecodeContext) -> Any:
        if not isinstance(data, str) or ":" not in data:
            raise ctx.error(f"expected a class as 'package.module:Class', got {data!r}")
        module_name, _, qualname = data.partition(":")
        return ctx.resolve_class(module_name, qualname)

    def describe(self, value: Any) -> str:
        return value.__name__


class _SubgraphsCodec(Codec):
    """Subgraphs from ``find``: ``[[[path, node_name], ...], ...]``, looked up by name when replayed."""

    def encode(self, value: Any, where: str) -> Any:
        from ..graph.subgraph import encode_subgraphs

        return encode_subgraphs(value)

    def decode(self, data: Any, ctx: DecodeContext) -> Any:
        from ..errors import SchedlangError
        from ..graph.subgraph import decode_subgraphs

        try:
            return decode_subgraphs(data)
        except (SchedlangError, TypeError, ValueError) as e:
            raise ctx.error(f"expected subgraphs as [[[path, node_name], ...], ...], got {short_repr(data)}") from e

    def for_replay(self, value: Any) -> Any:
        from ..graph.subgraph import decode_subgraphs, encode_subgraphs

        return decode_subgraphs(encode_subgraphs(value))

    def describe(self, value: Any) -> str:
        n = len(value)
        nodes = ", ".join("+".join(node.name if hasattr(node, "name") else str(node) for _, node in sg)
                          for sg in value[:3])
        return f"{n} subgraph{'s' if n != 1 else ''} [{nodes}{', ...' if n > 3 else ''}]"


#: plain data (numbers, strings, lists, dicts); other objects replay only in the same process
PLAIN = Codec()
#: a callable: plain in JSON terms (so only in-process), shown by its name
FUNCTION = _FunctionCodec()
#: subgraphs returned by ``find``
SUBGRAPHS = _SubgraphsCodec()


# ------------------------------------------------------------------------------------ the record

@dataclasses.dataclass(frozen=True)
class Param:
    """One argument of a primitive.

    * ``type``: an annotation (``int``, ``Optional[str]``, ``Type[nn.Module]``, ``Callable``,
      ``Sequence[str]`` ...), checked when the primitive is called and when a plan is read;
    * ``default``: :data:`REQUIRED` when the caller must give it;
    * ``option``: a keyword option (taken through ``**options``): recorded only when given;
    * ``variadic``: ``"*"`` or ``"**"`` for arguments passed on as they come (``*args`` /
      ``**kwargs`` of the method, recorded as a tuple / dict; default ``()`` / ``{}``);
    * ``expects`` / ``valid``: the words for "must be ..." and a hint of the valid values in
      type errors (``valid`` is called lazily); ``type_error`` replaces the whole message
      (a template with ``{where} {primitive} {name} {value} {type_name} {expects}``).
    """

    name: str
    type: Any = Any
    default: Any = REQUIRED
    doc: str = ""
    codec: Codec = PLAIN
    option: bool = False
    variadic: str = ""
    expects: str = ""
    valid: Optional[Callable[[], str]] = None
    type_error: str = ""

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def expected(self) -> str:
        """What the value must be, in words."""
        return self.expects or describe_type(self.type)

    def type_message(self, where: str, primitive: str, value: Any) -> str:
        expects = self.expected()
        if self.type_error:
            return self.type_error.format(where=where, primitive=primitive, name=self.name, value=short_repr(value),
                                          type_name=type(value).__name__, expects=expects)
        hint = f"; {self.valid()}" if self.valid is not None else ""
        return f"{where}: {primitive} {self.name} must be {expects}, got {short_repr(value)}{hint}"

    def doc_line(self) -> str:
        default = "" if self.required else f", default {self.default!r}"
        return f"{self.name} ({format_type(self.type)}{default}): {self.doc}"


def parameters_of(params: Sequence[Param]) -> Dict[str, Param]:
    return {p.name: p for p in params}

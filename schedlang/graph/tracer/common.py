"""Values shared by the tracer's pieces: the unknown-example marker, literal checks and small graph helpers."""

from __future__ import annotations

import inspect
import operator
from typing import Any, Iterable, List

import torch
import torch.fx as fx
from torch import nn

_P = inspect.Parameter
_LITERALS = (type(None), bool, int, float, str)


class _Unknown:
    """Example value that could not be computed."""

    def __repr__(self) -> str:
        return "<unknown>"


UNKNOWN = _Unknown()


class _NeedsExample(Exception):
    """Raised internally when an example value is needed but unknown."""


def module_device(module: nn.Module) -> torch.device:
    """The device of the module's first parameter, else of its first buffer, else the CPU."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def forward_parameters(module: nn.Module) -> List[inspect.Parameter]:
    """Parameters of ``type(module).forward`` (decorators unwrapped), without ``self``."""
    fn = inspect.unwrap(type(module).forward)
    params = list(inspect.signature(fn).parameters.values())
    return params[1:]


def _holds_tensor(value: Any) -> bool:
    return any(isinstance(v, (torch.Tensor, fx.Proxy)) for v in _leaves(value))


def _leaves(value: Any) -> Iterable[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, slice):
        yield from _leaves((value.start, value.stop, value.step))
    else:
        yield value


def _constant_key(v: Any):
    if isinstance(v, _LITERALS):
        return (type(v).__name__, v)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_constant_key(x) for x in v))
    if isinstance(v, (torch.dtype, torch.device)):
        return ("torch", str(v))
    return ("object", id(v))


def _literal_default(value: Any) -> bool:
    if isinstance(value, _LITERALS):
        return not isinstance(value, float) or value == value  # NaN has no repr that round-trips
    if isinstance(value, tuple):
        return all(_literal_default(v) for v in value)
    return False


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _describe_node(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    args = ", ".join(str(a) for a in node.args)
    return f"{node.name} = {target}({args})" if node.op != "placeholder" else node.name


_INFIX = {operator.gt: ">", operator.ge: ">=", operator.lt: "<", operator.le: "<=", operator.eq: "==",
          operator.ne: "!=", operator.add: "+", operator.sub: "-", operator.mul: "*", operator.floordiv: "//",
          operator.truediv: "/", operator.mod: "%", operator.and_: "&", operator.or_: "|"}


def _expression(value: Any, depth: int = 4, top: bool = True) -> str:
    """``value`` (a node or a constant) as a Python expression over the graph's inputs, for messages:
    ``hidden_states.size()[1] > 1``; nodes deeper than ``depth`` calls go by their names."""
    if not isinstance(value, fx.Node):
        return repr(value) if not isinstance(value, slice) else \
            ":".join("" if v is None else str(v) for v in (value.start, value.stop)) + \
            ("" if value.step is None else f":{value.step}")
    node = value
    if node.op in ("placeholder", "get_attr") or depth == 0:
        return str(node.target) if node.op != "placeholder" else node.name

    def sub(v):
        return _expression(v, depth - 1, top=False)

    if node.op == "call_function":
        if node.target in _INFIX and len(node.args) == 2:
            text = f"{sub(node.args[0])} {_INFIX[node.target]} {sub(node.args[1])}"
            return text if top else f"({text})"
        if node.target is operator.getitem:
            return f"{sub(node.args[0])}[{sub(node.args[1])}]"
        if node.target is getattr and len(node.args) == 2:
            return f"{sub(node.args[0])}.{node.args[1]}"
        if node.target is operator.not_:
            return f"not {sub(node.args[0])}"
        name = getattr(node.target, "__name__", str(node.target))
        return f"{name}({', '.join(sub(a) for a in node.args)})"
    if node.op == "call_method":
        return f"{sub(node.args[0])}.{node.target}({', '.join(sub(a) for a in node.args[1:])})"
    return node.name


def _reserve_name(graph: fx.Graph, name: str) -> None:
    namespace = getattr(graph, "_graph_namespace", None)
    if namespace is not None and hasattr(namespace, "create_name"):
        namespace.create_name(name, None)


def _guard_value(value: Any) -> Any:
    return value if _literal_default(value) else "<object>"


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


_PURE_FUNCTIONS = {getattr, operator.getitem, len, *[getattr(operator, n) for n in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "neg", "pos", "eq", "ne", "lt", "le", "gt", "ge", "not_",
    "and_", "or_", "xor", "is_", "is_not", "contains")]}
_PURE_METHODS = {"size", "dim", "numel", "stride", "is_contiguous", "__getitem__"}


def _eliminate_dead_queries(graph: fx.Graph) -> None:
    """Drop the shape queries that only served Python control flow (``bool(q_len > 1)``)."""
    for node in reversed(list(graph.nodes)):
        if node.users:
            continue
        if (node.op == "call_function" and node.target in _PURE_FUNCTIONS) or \
                (node.op == "call_method" and node.target in _PURE_METHODS) or node.op == "get_attr":
            graph.erase_node(node)


def _new_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)



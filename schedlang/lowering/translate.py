"""From an FX subgraph and concrete input shapes to the fused-kernel IR.

:func:`unsupported_nodes` looks at the graph alone (which targets have a lowering) and is
what ``lower_subgraph`` checks up front. :func:`specialize` takes the input shapes and
dtypes, runs the graph once on fake tensors (PyTorch's own shape and type-promotion
rules), classifies every input against the broadcast shape (rows x last dimension), and
translates node by node through :mod:`schedlang.lowering.op_table`.

Example::

    gm = torch.fx.symbolic_trace(lambda x, b: F.gelu(x + b))
    spec = specialize(gm, gm, [((8, 16), torch.float32), ((16,), torch.float32)], "BiasGeLU")
    [i.kind for i in spec.inputs]   # ['full', 'col']
"""

from __future__ import annotations

import keyword
import logging
import math
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx

from ..errors import LoweringError
from . import op_table
from .ir import Graph, Value

__all__ = ["InputSpec", "OutputSpec", "Specialization", "specialize", "unsupported_nodes", "format_node",
           "lowering_error"]

_LOW_PRECISION = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class InputSpec:
    """One tensor the kernels read: a subgraph argument or an attribute (a parameter)."""
    source: tuple            # ("arg", position) or ("attr", qualified name)
    name: str                # identifier used in the generated code
    shape: tuple
    dtype: torch.dtype
    kind: str                # "full", "row", "col" or "scalar"
    expand: bool = False     # partially broadcast: materialized as full on the host
    value: Value | None = None


@dataclass
class OutputSpec:
    name: str
    shape: tuple
    dtype: torch.dtype
    value: Value


@dataclass
class Specialization:
    """The IR of a subgraph for one set of input shapes and dtypes."""
    name: str
    graph: Graph
    inputs: list
    outputs: list
    full_shape: tuple
    n_rows: int
    n_cols: int
    compute_dtype: torch.dtype
    dropout_ps: list = field(default_factory=list)
    single_output: bool = False
    node_text: dict = field(default_factory=dict)  # origin name -> "add = operator.add(x, bias)"


def _identifier(name: str, taken: set) -> str:
    base = re.sub(r"\W", "_", name).strip("_") or "t"
    if base[0].isdigit() or keyword.iskeyword(base):
        base = f"v_{base}"
    candidate, k = base, 1
    while candidate in taken:
        candidate = f"{base}_{k}"
        k += 1
    taken.add(candidate)
    return candidate


def format_node(node: torch.fx.Node, owner=None) -> str:
    """``gelu = F.gelu(add, approximate='tanh')``: one readable line per FX node."""
    def fmt(a):
        if isinstance(a, torch.fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            inner = ", ".join(fmt(x) for x in a)
            return f"({inner},)" if isinstance(a, tuple) and len(a) == 1 else (
                f"({inner})" if isinstance(a, tuple) else f"[{inner}]")
        if isinstance(a, torch.dtype):
            return str(a)
        return repr(a)
    args = [fmt(a) for a in node.args]
    args += [f"{k}={fmt(v)}" for k, v in node.kwargs.items() if not (k == "_stacklevel")]
    if node.op == "call_method":
        return f"{node.name} = {args[0]}.{node.target}({', '.join(args[1:])})"
    if node.op == "call_module":
        return f"{node.name} = self.{node.target}({', '.join(args)})  # {op_table.describe_target(node, owner)}"
    return f"{node.name} = {op_table.describe_target(node, owner)}({', '.join(args)})"


def unsupported_nodes(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, str]]:
    """Nodes whose operation has no Triton lowering, with a reason (no shapes needed)."""
    found = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            if op_table.lookup(node) is None:
                found.append((node, f"{op_table.describe_target(node)} has no triton lowering"))
        elif node.op == "call_module":
            try:
                mod = gm.get_submodule(node.target)
            except AttributeError:
                found.append((node, f"module {node.target!r} not found"))
                continue
            if op_table.module_handler(mod) is None:
                found.append((node, f"{op_table.describe_target(node, gm)} is not a module the triton compiler "
                                    "knows (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, "
                                    "nn.LayerNorm, nn.RMSNorm, nn.Softmax, nn.Identity)"))
    return found


def lowering_error(name: str, problems: list[tuple[torch.fx.Node | None, str]], owner=None) -> LoweringError:
    """One error listing every problem, naming the compilers that take any PyTorch op."""
    lines = []
    for node, reason in problems:
        where = f"node '{node.name}' ({format_node(node, owner)})" if node is not None else "subgraph"
        lines.append(f"  - {where}: {reason}")
    n = len(problems)
    return LoweringError(
        f"cannot fuse subgraph '{name}' with compiler='triton': {n} unsupported operation{'s' * (n != 1)}:\n"
        + "\n".join(lines)
        + "\nuse compiler='inductor' (torch.compile) or compiler='eager' for this subgraph, "
          "or leave these operations out of it")


class _PropagationFailure(Exception):
    def __init__(self, node, reason):
        super().__init__(reason)
        self.node, self.reason = node, reason


class _FakeProp(torch.fx.Interpreter):
    def __init__(self, owner, graph):
        super().__init__(owner, graph=graph)
        self.metas = {}

    def run_node(self, n):
        try:
            result = super().run_node(n)
        except Exception as exc:
            raise _PropagationFailure(n, str(exc).strip().splitlines()[0] if str(exc).strip() else
                                      type(exc).__name__) from None
        if isinstance(result, torch.Tensor):
            self.metas[n] = (tuple(result.shape), result.dtype)
        return result


def fake_propagate(owner: torch.nn.Module, graph: torch.fx.Graph, metas, device=None):
    """Shapes and dtypes of every node for inputs of the given (shape, dtype)s, computed by
    PyTorch itself on fake tensors (no memory, no kernels)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # a subgraph that rejects these shapes is reported by our error; keep the fake-tensor
    # machinery from logging the same failure as an internal error
    fake_logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_logger.level
    fake_logger.setLevel(logging.CRITICAL)
    try:
        with mode:
            fakes = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in metas]
            prop = _FakeProp(owner, graph)
            prop.run(*fakes)
    finally:
        fake_logger.setLevel(level)
    return prop.metas


def _classify(shape: tuple, full: tuple) -> tuple[str, bool]:
    """Kind of an input of ``shape`` within the broadcast shape ``full``, and whether it must
    be expanded on the host (broadcast over some but not all leading dimensions)."""
    d = len(full)
    padded = (1,) * (d - len(shape)) + tuple(shape)
    if padded == tuple(full):
        return "full", False
    if math.prod(shape) == 1:
        return "scalar", False
    n = full[-1]
    if padded[-1] == n and all(s == 1 for s in padded[:-1]):
        return "col", False
    if padded[-1] == 1 and padded[:-1] == tuple(full[:-1]):
        return "row", False
    return "full", True


class _Translator:
    def __init__(self, gm, owner, metas, name, dropout_training=None):
        self.gm, self.owner, self.name = gm, owner, name
        self.g = Graph()
        self.metas = metas
        self.inputs: list[InputSpec] = []
        self._attr_inputs: dict[str, InputSpec] = {}
        self._taken: set = {"n_rows", "n_cols", "seed", "pid", "rows", "cols", "mask", "row_mask", "col_mask",
                            "tl", "triton", "BLOCK_R", "BLOCK_N", "row_block", "INF", "tanh", "n_cols_f"}
        self.dropout_ps: list[float] = []
        self.problems: list = []
        self.env: dict = {}

    # ---------------------------------------------------------------- helpers used by handlers
    def node_dtype(self, node):
        return self.metas[node][1]

    def cast(self, value: Value, dtype: torch.dtype) -> Value:
        if dtype not in _FLOATS:
            raise op_table.Unsupported(f"cast to {dtype} (only floating-point dtypes are fused)")
        if dtype in _LOW_PRECISION:
            return self.g.round_to(value, _LOW_PRECISION[dtype])
        if dtype == torch.float32 and self.compute_dtype == torch.float64:
            return self.g.round_to(value, "float32")
        return value

    def attr_input(self, qualname: str) -> Value:
        spec = self._attr_inputs.get(qualname)
        if spec is None:
            tensor = fetch_attr(self.owner, qualname)
            if not isinstance(tensor, torch.Tensor):
                raise op_table.Unsupported(f"attribute {qualname!r} is not a tensor")
            spec = self._add_input(("attr", qualname), qualname, tuple(tensor.shape), tensor.dtype)
            self._attr_inputs[qualname] = spec
        return spec.value

    def new_dropout(self, p: float) -> Value:
        self.dropout_ps.append(p)
        return self.g.keep_mask(p, len(self.dropout_ps) - 1)

    def meta_of(self, node, value) -> tuple:
        for arg in node.all_input_nodes:
            if self.env.get(arg) is value and arg in self.metas:
                return self.metas[arg]
        raise op_table.Unsupported("argument is not a tensor of the subgraph")

    def ndim_of(self, node, value) -> int:
        for arg in node.all_input_nodes:
            if self.env.get(arg) is value and arg in self.metas:
                return len(self.metas[arg][0])
        return len(self.full_shape) - (1 if value.squeezed else 0)

    # ---------------------------------------------------------------- translation
    def _add_input(self, source, label, shape, dtype) -> InputSpec:
        if dtype not in _FLOATS and dtype != torch.bool:
            raise op_table.Unsupported(f"input of dtype {dtype} (floating-point and bool tensors are fused)")
        kind, expand = _classify(shape, self.full_shape)
        spec = InputSpec(source, _identifier(label, self._taken), shape, dtype, kind, expand)
        spec.value = self.g.input(len(self.inputs), rows=kind in ("full", "row"), cols=kind in ("full", "col"),
                                  name=spec.name, is_bool=dtype == torch.bool)
        self.inputs.append(spec)
        return spec

    def run(self, arg_metas) -> Specialization:
        tensor_shapes = [shape for shape, _ in arg_metas]
        graph_nodes = list(self.gm.graph.nodes)
        for node in graph_nodes:
            if node.op == "get_attr":
                t = fetch_attr(self.owner, node.target)
                if isinstance(t, torch.Tensor):
                    tensor_shapes.append(tuple(t.shape))
        try:
            self.full_shape = tuple(torch.broadcast_shapes(*tensor_shapes)) if tensor_shapes else ()
        except RuntimeError as exc:
            raise lowering_error(self.name, [(None, f"the input shapes {tensor_shapes} do not broadcast "
                                                   f"together ({exc})")], self.owner) from None
        dtypes = {dtype for _, dtype in self.metas.values()}
        self.compute_dtype = torch.float64 if torch.float64 in dtypes else torch.float32
        self.n_cols = self.full_shape[-1] if self.full_shape else 1
        self.n_rows = math.prod(self.full_shape[:-1]) if self.full_shape else 1

        node_text = {}
        placeholder_index = 0
        outputs = None
        for node in graph_nodes:
            if node.op.startswith("call_"):
                node_text[node.name] = format_node(node, self.owner)
            self.g.set_origin(node.name)
            try:
                if node.op == "placeholder":
                    if placeholder_index >= len(arg_metas):  # a defaulted, non-tensor argument
                        self.env[node] = node.args[0] if node.args else None
                        continue
                    shape, dtype = arg_metas[placeholder_index]
                    placeholder_index += 1
                    self.env[node] = self._add_input(("arg", placeholder_index - 1), node.name, shape, dtype).value
                elif node.op == "get_attr":
                    self.env[node] = self.attr_input(node.target)
                elif node.op == "output":
                    outputs = node.args[0]
                else:
                    self._translate(node)
            except op_table.Unsupported as exc:
                self.problems.append((node, str(exc)))
        self.g.set_origin(None)
        out_specs, single = self._outputs(outputs)
        if self.problems:
            raise lowering_error(self.name, self.problems, self.owner)
        return Specialization(self.name, self.g, self.inputs, out_specs, self.full_shape, self.n_rows, self.n_cols,
                              self.compute_dtype, self.dropout_ps, single, node_text)

    def _translate(self, node):
        if any(arg not in self.env for arg in node.all_input_nodes):
            return  # depends on a node that already failed: reported once, there
        args = torch.fx.node.map_arg(node.args, lambda n: self.env[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self.env[n])
        ctx = _Context(self.g, node, self)
        if node.op == "call_module":
            mod = self.owner.get_submodule(node.target)
            handler = op_table.module_handler(mod)
            if handler is None:
                raise op_table.Unsupported(f"{op_table.describe_target(node, self.owner)} has no triton lowering")
            value = handler(ctx, mod, *args, **kwargs)
        else:
            handler = op_table.lookup(node)
            if handler is None:
                raise op_table.Unsupported(f"{op_table.describe_target(node)} has no triton lowering")
            try:
                value = handler(ctx, *args, **kwargs)
            except TypeError as exc:  # an argument combination the handler does not take
                raise op_table.Unsupported(f"arguments not supported ({exc})") from None
        if getattr(handler, "returns_python", False) and not isinstance(value, Value):
            self.env[node] = value  # a shape, dtype or size: a constant of this specialization
            return
        if not isinstance(value, Value):
            raise op_table.Unsupported("does not produce a tensor")
        if node not in self.metas:
            raise op_table.Unsupported("does not produce a tensor")
        shape, dtype = self.metas[node]
        if not _shape_agrees(shape, self.full_shape, value):
            # folded algebra (x * 0, dropout with p=1) can leave a value with fewer axes
            # than PyTorch's result: broadcast it back
            for rows, cols in ((value.rows, True), (True, value.cols), (True, True)):
                if (rows, cols) != (value.rows, value.cols) and _shape_agrees(
                        shape, self.full_shape, _Axes(rows, cols, value.squeezed)):
                    value = self.g.broadcast(value, rows, cols)
                    break
        if not _shape_agrees(shape, self.full_shape, value):
            if value.squeezed and (value.cols or len(shape) == len(self.full_shape)):
                raise op_table.Unsupported(
                    f"mixes a reduction taken without keepdim=True with tensors that keep the last dimension "
                    f"(PyTorch broadcasts the reduced tensor along another axis, giving shape {tuple(shape)}); "
                    "reduce with keepdim=True")
            raise op_table.Unsupported(
                f"produces shape {tuple(shape)}, which is not an elementwise broadcast of the subgraph's "
                f"rows x last-dimension grid {tuple(self.full_shape)} (as {value.kind} values)")
        if dtype not in _FLOATS and dtype != torch.bool:
            raise op_table.Unsupported(f"produces dtype {dtype} (floating-point and bool tensors are fused)")
        self.env[node] = value

    def _outputs(self, outputs):
        single = not isinstance(outputs, (tuple, list))
        items = [outputs] if single else list(outputs)
        specs = []
        taken = set(self._taken) | {s.name for s in self.inputs}
        for k, item in enumerate(items):
            if not isinstance(item, torch.fx.Node):
                self.problems.append((None, f"output {k} is {item!r}, not a tensor computed by the subgraph"))
                continue
            if item not in self.env:
                continue  # its node already reported a problem
            shape, dtype = self.metas[item]
            value = self.env[item]
            want = _class_shape(self.full_shape, value)
            padded = (1,) * (len(want) - len(shape)) + tuple(shape)
            if len(shape) > len(want) or padded != want:
                self.problems.append((item, f"output of shape {tuple(shape)} is broadcast over some leading "
                                            f"dimensions of {tuple(self.full_shape)}; only outputs spanning all "
                                            "rows (or none) are fused"))
                continue
            specs.append(OutputSpec(_identifier(f"out_{item.name}", taken), tuple(shape), dtype, value))
        return specs, single


class _Context(op_table.OpContext):
    def ndim(self, value):
        return self._translator.ndim_of(self.node, value)


@dataclass
class _Axes:
    rows: bool
    cols: bool
    squeezed: bool = False


def _class_shape(full: tuple, value: Value) -> tuple:
    """The exact PyTorch shape of a value of this kind spanning all rows."""
    d = len(full)
    if value.squeezed:
        return tuple(full[:-1]) if value.rows else (1,) * (d - 1)
    return tuple((full[i] if (value.rows if i < d - 1 else value.cols) else 1) for i in range(d))


def _shape_agrees(shape: tuple, full: tuple, value: Value) -> bool:
    """Whether a node's PyTorch shape is a form of its IR kind: equal to the kind's shape,
    except that leading dimensions may still be broadcast (size 1) where PyTorch keeps a
    partially broadcast input unexpanded (the values are the same along them)."""
    want = _class_shape(full, value)
    if len(shape) > len(want):
        return False
    padded = (1,) * (len(want) - len(shape)) + tuple(shape)
    for i, (p, w) in enumerate(zip(padded, want)):
        is_last = i == len(want) - 1 and not value.squeezed
        if p != w and (p != 1 or is_last):
            return False
    return True


def fetch_attr(owner, qualname: str):
    """``owner.a.b.c`` for ``qualname`` ``"a.b.c"`` (a get_attr node's target)."""
    return operator.attrgetter(qualname)(owner)


def specialize(gm: torch.fx.GraphModule, owner: torch.nn.Module, arg_metas, name: str,
               device=None) -> Specialization:
    """Translate ``gm`` for arguments of the given ``(shape, dtype)`` pairs.

    ``owner`` resolves ``get_attr`` and ``call_module`` targets (the fused module, which
    holds the subgraph's parameters under their original names); ``device`` is where the
    inputs live (PyTorch checks it against the parameters' device). Raises
    :class:`~schedlang.errors.LoweringError` listing every operation it cannot lower.
    """
    arg_metas = [(tuple(shape), dtype) for shape, dtype in arg_metas]
    try:
        metas = fake_propagate(owner, gm.graph, arg_metas, device)
    except _PropagationFailure as exc:  # PyTorch itself rejects these shapes or dtypes
        shapes = ", ".join(f"{tuple(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype in arg_metas)
        raise lowering_error(name, [(exc.node, f"PyTorch rejects it for inputs of shapes {shapes}: {exc.reason}")],
                             owner) from None
    return _Translator(gm, owner, metas, name).run(arg_metas)

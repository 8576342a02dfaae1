"""The IR's operations, each defined once: arity, result type, constant folding, PyTorch
reference, Triton expression and derivative.

:mod:`~schedlang.lowering.ir` builds values of these ops, :mod:`~schedlang.lowering.autodiff`
differentiates them with :attr:`IROp.vjp`, :mod:`~schedlang.lowering.triton_codegen` prints
them with :attr:`IROp.triton`, :mod:`~schedlang.lowering.op_table` maps the PyTorch functions
listed in :attr:`IROp.torch_functions` onto them, and :func:`evaluate` runs a graph with the
:attr:`IROp.eager` references (the tests check kernels and derivatives against it).

Adding an op is one entry here plus, where it simplifies, a builder method in ``ir.Graph``.

Example::

    op = IR_OPS["tanh"]
    assert op.arity == 1 and op.fold(0.0) == 0.0
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

__all__ = ["IROp", "IR_OPS", "ops_of", "evaluate"]

_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
#: float types a ``round`` op rounds to
ROUND_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class IROp:
    """One operation of the IR.

    ``category`` is one of ``leaf`` (no value operands), ``unary``, ``binary``, ``compare``
    (two operands, a boolean result), ``select`` (``where``), ``reduce`` (over the column
    axis, keepdim) and ``structural`` (same numbers, another shape or rounding).
    ``triton(emitter, value)`` returns the Triton expression; ``vjp(graph, value, grad)``
    returns ``(operand, contribution)`` pairs (unreduced, see autodiff); ``eager(value,
    *operand_tensors)`` computes the op in PyTorch.
    """

    name: str
    category: str
    arity: int
    eager: Optional[Callable] = None
    fold: Optional[Callable] = None
    triton: Optional[Callable] = None
    vjp: Optional[Callable] = None
    torch_functions: Tuple = ()
    torch_methods: Tuple[str, ...] = ()

    @property
    def returns_bool(self) -> bool:
        return self.category == "compare"


IR_OPS: Dict[str, IROp] = {}


def _op(name: str, category: str, arity: int, **fields) -> IROp:
    op = IROp(name, category, arity, **fields)
    IR_OPS[name] = op
    return op


def ops_of(*categories: str) -> frozenset:
    """Names of the ops in these categories."""
    return frozenset(name for name, op in IR_OPS.items() if op.category in categories)


# ------------------------------------------------------------------------------ leaves
# their code and values come from the kernel's inputs, so the code generator and evaluate
# handle them; none has a derivative rule (gradients stop there)
for _name in ("input", "const", "ncols", "keep_mask", "grad_output"):
    _op(_name, "leaf", 0)


# ------------------------------------------------------------------------------ arithmetic
def _infix(symbol: str, on_refs: bool = False) -> Callable:
    if on_refs:  # boolean operands: compared as they are
        return lambda e, v: f"{e.ref(v.args[0])} {symbol} {e.ref(v.args[1])}"
    return lambda e, v: f"{e.num(v.args[0])} {symbol} {e.num(v.args[1])}"


_op("add", "binary", 2, eager=lambda v, a, b: a + b, fold=operator.add, triton=_infix("+"),
    vjp=lambda g, v, grad: [(v.args[0], grad), (v.args[1], grad)])
_op("sub", "binary", 2, eager=lambda v, a, b: a - b, fold=operator.sub, triton=_infix("-"),
    vjp=lambda g, v, grad: [(v.args[0], grad), (v.args[1], g.neg(grad))])
_op("mul", "binary", 2, eager=lambda v, a, b: a * b, fold=operator.mul, triton=_infix("*"),
    vjp=lambda g, v, grad: [(v.args[0], g.mul(grad, v.args[1])), (v.args[1], g.mul(grad, v.args[0]))])
# d(a/b)/db = -(a/b)/b, written with the value itself
_op("div", "binary", 2, eager=lambda v, a, b: a / b, fold=operator.truediv, triton=_infix("/"),
    vjp=lambda g, v, grad: [(v.args[0], g.div(grad, v.args[1])),
                            (v.args[1], g.neg(g.div(g.mul(grad, v), v.args[1])))])
_op("neg", "unary", 1, eager=lambda v, a: -a, fold=operator.neg, triton=lambda e, v: f"-{e.num(v.args[0])}",
    vjp=lambda g, v, grad: [(v.args[0], g.neg(grad))])


def _tl_call(function: str) -> Callable:
    return lambda e, v: f"{function}({e.num(v.args[0])})"


_op("exp", "unary", 1, eager=lambda v, a: torch.exp(a), fold=math.exp, triton=_tl_call("tl.exp"),
    vjp=lambda g, v, grad: [(v.args[0], g.mul(grad, v))], torch_functions=(torch.exp,), torch_methods=("exp",))
_op("log", "unary", 1, eager=lambda v, a: torch.log(a), fold=math.log, triton=_tl_call("tl.log"),
    vjp=lambda g, v, grad: [(v.args[0], g.div(grad, v.args[0]))], torch_functions=(torch.log,),
    torch_methods=("log",))
_op("sqrt", "unary", 1, eager=lambda v, a: torch.sqrt(a), fold=math.sqrt, triton=_tl_call("tl.sqrt"),
    vjp=lambda g, v, grad: [(v.args[0], g.div(g.mul(grad, 0.5), v))], torch_functions=(torch.sqrt,),
    torch_methods=("sqrt",))
# d x^-1/2 = -1/2 x^-3/2 = -1/2 v^3
_op("rsqrt", "unary", 1, eager=lambda v, a: torch.rsqrt(a), fold=lambda x: 1.0 / math.sqrt(x),
    triton=_tl_call("tl.rsqrt"), vjp=lambda g, v, grad: [(v.args[0], g.mul(grad, g.mul(g.mul(v, g.mul(v, v)), -0.5)))],
    torch_functions=(torch.rsqrt,), torch_methods=("rsqrt",))
# a low-precision kernel on a GPU uses the hardware approximation (see triton_codegen)
_op("tanh", "unary", 1, eager=lambda v, a: torch.tanh(a), fold=math.tanh,
    triton=lambda e, v: f"{'tanh_approx' if e.fast_tanh else 'tanh'}({e.num(v.args[0])})",
    vjp=lambda g, v, grad: [(v.args[0], g.mul(grad, g.sub(1.0, g.mul(v, v))))],
    torch_functions=(torch.tanh, F.tanh), torch_methods=("tanh",))
_op("sigmoid", "unary", 1, eager=lambda v, a: torch.sigmoid(a), fold=lambda x: 1.0 / (1.0 + math.exp(-x)),
    triton=_tl_call("tl.sigmoid"), vjp=lambda g, v, grad: [(v.args[0], g.mul(grad, g.mul(v, g.sub(1.0, v))))],
    torch_functions=(torch.sigmoid, F.sigmoid), torch_methods=("sigmoid",))
_op("erf", "unary", 1, eager=lambda v, a: torch.erf(a), fold=math.erf, triton=_tl_call("tl.erf"),
    vjp=lambda g, v, grad: [(v.args[0], g.mul(grad, g.mul(g.exp(g.neg(g.mul(v.args[0], v.args[0]))),
                                                            _TWO_OVER_SQRT_PI)))],
    torch_functions=(torch.erf, torch.special.erf), torch_methods=("erf",))


def _abs_vjp(g, v, grad):
    a = v.args[0]  # sign(a), 0 at 0 as in PyTorch
    sign = g.where(g.compare("gt", a, 0.0), 1.0, g.where(g.compare("lt", a, 0.0), -1.0, 0.0))
    return [(a, g.mul(grad, sign))]


_op("abs", "unary", 1, eager=lambda v, a: torch.abs(a), fold=abs, triton=_tl_call("tl.abs"), vjp=_abs_vjp,
    torch_functions=(torch.abs, torch.absolute), torch_methods=("abs",))
# PyTorch: zero gradient at 0
_op("relu", "unary", 1, eager=lambda v, a: torch.relu(a), fold=lambda x: max(x, 0.0),
    triton=lambda e, v: f"tl.maximum({e.num(v.args[0])}, 0.0)",
    vjp=lambda g, v, grad: [(v.args[0], g.where(g.compare("gt", v.args[0], 0.0), grad, 0.0))])


def _extremum_vjp(wins_when: str) -> Callable:
    def vjp(g, v, grad):  # ties split the gradient evenly, as PyTorch does
        a, b = v.args
        wins, tie, half = g.compare(wins_when, a, b), g.compare("eq", a, b), g.mul(grad, 0.5)
        return [(a, g.where(wins, grad, g.where(tie, half, 0.0))), (b, g.where(wins, 0.0, g.where(tie, half, grad)))]
    return vjp


_op("maximum", "binary", 2, eager=lambda v, a, b: torch.maximum(a, b), fold=max,
    triton=lambda e, v: f"tl.maximum({e.num(v.args[0])}, {e.num(v.args[1])})", vjp=_extremum_vjp("gt"))
_op("minimum", "binary", 2, eager=lambda v, a, b: torch.minimum(a, b), fold=min,
    triton=lambda e, v: f"tl.minimum({e.num(v.args[0])}, {e.num(v.args[1])})", vjp=_extremum_vjp("lt"))


# ------------------------------------------------------------------------------ logic
for _name, _symbol, _fn in (("gt", ">", operator.gt), ("ge", ">=", operator.ge), ("lt", "<", operator.lt),
                            ("le", "<=", operator.le), ("eq", "==", operator.eq), ("ne", "!=", operator.ne)):
    _op(_name, "compare", 2, eager=(lambda f: lambda v, a, b: f(a, b))(_fn), fold=_fn, triton=_infix(_symbol),
        torch_functions=(_fn, getattr(torch, _name)), torch_methods=(_name, f"__{_name}__"))
_op("and", "compare", 2, eager=lambda v, a, b: a & b, fold=lambda x, y: bool(x) and bool(y),
    triton=_infix("&", on_refs=True))
_op("or", "compare", 2, eager=lambda v, a, b: a | b, fold=lambda x, y: bool(x) or bool(y),
    triton=_infix("|", on_refs=True))
_op("where", "select", 3, eager=lambda v, c, a, b: torch.where(c, a, b),
    triton=lambda e, v: f"tl.where({e.ref(v.args[0])}, {e.num(v.args[1])}, {e.num(v.args[2])})",
    vjp=lambda g, v, grad: [(v.args[1], g.where(v.args[0], grad, 0.0)), (v.args[2], g.where(v.args[0], 0.0, grad))])


# ------------------------------------------------------------------------------ shape and rounding
def _identity_vjp(g, v, grad):
    # a cast's gradient is cast back: the identity in the compute dtype
    return [(v.args[0], grad)]


def _round_eager(v, a):
    return a.to(ROUND_DTYPES[v.attr("dtype")]).to(a.dtype)


def _row0_eager(v, a):
    rows = torch.arange(a.shape[0], device=a.device).unsqueeze(1)
    return torch.where(rows == 0, a, torch.zeros((), dtype=a.dtype, device=a.device))


_op("round", "structural", 1, eager=_round_eager, triton=lambda e, v: e.round_to(e.num(v.args[0]), v.attr("dtype")),
    vjp=_identity_vjp)
_op("row0", "structural", 1, eager=_row0_eager,
    triton=lambda e, v: f"tl.where(rows == 0, {e.num(v.args[0])}, 0.0)", vjp=_identity_vjp)
_op("alias", "structural", 1, eager=lambda v, a: a, triton=lambda e, v: e.num(v.args[0]), vjp=_identity_vjp)
# evaluate() expands the value over the axes it gains
_op("broadcast", "structural", 1, eager=lambda v, a: a, triton=lambda e, v: e.tile(v.args[0], v.rows, v.cols),
    vjp=_identity_vjp)


# ------------------------------------------------------------------------------ reductions
def _rowmax_vjp(g, v, grad):
    if not v.attr("grad"):  # a max that only shifts values for range (softmax) has no gradient
        return []
    # the gradient goes to the maxima, split evenly among ties (as torch.amax)
    a = v.args[0]
    is_max = g.compare("eq", a, v)
    count = g.rowsum(g.where(is_max, 1.0, 0.0))
    return [(a, g.where(is_max, g.div(g.rowsum(grad), count), 0.0))]


def _row_reduction(function: str, padding: str) -> Callable:
    def triton(e, v):
        a = v.args[0]
        return f"tl.{function}(tl.where({e.mask_for(a.rows, a.cols)}, {e.num(a)}, {padding}), axis=1, keep_dims=True)"
    return triton


_op("rowsum", "reduce", 1, eager=lambda v, a: a.sum(-1, keepdim=True), triton=_row_reduction("sum", "0.0"),
    vjp=lambda g, v, grad: [(v.args[0], g.rowsum(grad))])  # the true gradient of the sum, over columns
_op("rowmax", "reduce", 1, eager=lambda v, a: a.amax(-1, keepdim=True), triton=_row_reduction("max", "-INF"),
    vjp=_rowmax_vjp)


# ------------------------------------------------------------------------------ reference evaluation
def evaluate(values: Sequence, inputs: Dict[int, torch.Tensor], n_cols: int,
             grad_outputs: Optional[Dict[int, torch.Tensor]] = None, dtype=torch.float64) -> Dict[int, torch.Tensor]:
    """Run IR values (in build order) with the PyTorch references; returns tensors by value id.

    A value of kind ``full`` is a ``(rows, n_cols)`` tensor, ``row`` ``(rows, 1)``, ``col``
    ``(1, n_cols)`` and ``scalar`` ``(1, 1)``; ``inputs`` and ``grad_outputs`` are given that
    way, by their index. Dropout masks (``keep_mask``) have no reference here.
    """
    out: Dict[int, torch.Tensor] = {}
    for v in values:
        if v.op == "input":
            out[v.id] = inputs[v.attr("index")]
        elif v.op == "grad_output":
            out[v.id] = (grad_outputs or {})[v.attr("index")]
        elif v.op == "const":
            value = v.const_value
            out[v.id] = torch.tensor([[value]], dtype=torch.bool if isinstance(value, bool) else dtype)
        elif v.op == "ncols":
            out[v.id] = torch.tensor([[float(n_cols)]], dtype=dtype)
        elif v.op == "keep_mask":
            raise NotImplementedError("dropout masks have no eager reference in evaluate")
        else:  # PyTorch's broadcasting spans the axes a value does not hold
            out[v.id] = IR_OPS[v.op].eager(v, *(out[a.id] for a in v.args))
            if v.op == "broadcast":  # ... except where the value is materialized over them
                n_rows = max(t.shape[0] for t in inputs.values())
                result = out[v.id]
                out[v.id] = result.expand(n_rows if v.rows else result.shape[0], n_cols if v.cols else result.shape[1])
    return out

"""A small expression IR for fused row-wise kernels.

Every tensor in a lowered subgraph is seen as a view of one ``rows x n_cols`` grid: the
leading dimensions of the broadcast shape are flattened into rows and the last
dimension is the column axis. A value is described by which of the two axes it spans:

=========  =====  =====  ==========================================================
kind       rows   cols   example
=========  =====  =====  ==========================================================
full       yes    yes    activations ``(B, T, H)``
row        yes    no     ``x.mean(-1, keepdim=True)``, an input of shape ``(B, T, 1)``
col        no     yes    a bias or LayerNorm weight of shape ``(H,)``
scalar     no     no     a Python number, a 0-d tensor
=========  =====  =====  ==========================================================

Combining two values spans the union of their axes (``row + col -> full``); reducing over
the last dimension drops the column axis. Values are hash-consed (building the same
expression twice returns the same :class:`Value`) and simple algebra is folded at build
time (``x * 1``, ``x + 0``, constants), which keeps the derived backward small.

Everything is computed in one *compute dtype* (float32, or float64 when the subgraph uses
float64); the nominal PyTorch dtype of a value only matters where the program casts
explicitly (``.to(torch.bfloat16)`` rounds) and when results are stored.

Example::

    g = Graph()
    x = g.input(0, rows=True, cols=True, name="x")
    b = g.input(1, rows=False, cols=True, name="b")
    y = g.mul(g.add(x, b), g.const(0.5))
    assert (y.rows, y.cols) == (True, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .ir_ops import IR_OPS, ops_of

__all__ = ["Value", "Graph", "LEAF_OPS", "UNARY_OPS", "BINARY_OPS", "COMPARE_OPS", "REDUCE_OPS"]

#: Ops without value operands.
LEAF_OPS = ops_of("leaf")
#: Pointwise ops of one operand.
UNARY_OPS = ops_of("unary", "structural")
#: Pointwise ops of two operands producing a number.
BINARY_OPS = ops_of("binary")
#: Pointwise ops of two operands producing a boolean.
COMPARE_OPS = ops_of("compare")
#: Reductions over the column axis (keepdim; the result spans rows only).
REDUCE_OPS = ops_of("reduce")


@dataclass(eq=False)
class Value:
    """One node of the expression DAG.

    ``rows``/``cols`` say which axes of the ``rows x n_cols`` grid the value spans;
    ``is_bool`` marks comparison results; ``squeezed`` marks a row value whose last
    dimension was reduced away (``x.sum(-1)`` without keepdim: same numbers as the keepdim
    form, a different PyTorch shape); ``origin`` is a short tag naming the FX node
    (or the gradient of one) the value was built for, used to name and comment the
    generated code.
    """

    id: int
    op: str
    args: tuple
    attrs: tuple
    rows: bool
    cols: bool
    is_bool: bool = False
    squeezed: bool = False
    origin: tuple | None = None
    name_hint: str | None = None
    meta: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return {(True, True): "full", (True, False): "row", (False, True): "col", (False, False): "scalar"}[
            (self.rows, self.cols)]

    def attr(self, key, default=None):
        return dict(self.attrs).get(key, default)

    @property
    def is_const(self) -> bool:
        return self.op == "const"

    @property
    def const_value(self):
        return self.attr("value")

    def __repr__(self) -> str:
        args = ", ".join(f"%{a.id}" for a in self.args)
        attrs = ", ".join(f"{k}={v!r}" for k, v in self.attrs)
        inner = ", ".join(s for s in (args, attrs) if s)
        return f"%{self.id} = {self.op}({inner}) [{self.kind}]"


class Graph:
    """Builder of :class:`Value` DAGs with hash-consing and constant folding.

    ``origin`` (set with :meth:`set_origin`) tags every value built until the next call,
    so the code generator can group and comment the lines of each FX node.
    """

    def __init__(self):
        self.values: list[Value] = []
        self._memo: dict[tuple, Value] = {}
        self._origin = None
        #: when False (while deriving gradients) every value is built unsqueezed: shapes of
        #: gradients never reach PyTorch, and one flag value keeps hash-consing effective
        self.track_squeeze = True

    # ------------------------------------------------------------------ plumbing
    def set_origin(self, origin):
        self._origin = origin

    def _make(self, op, args=(), attrs=(), rows=None, cols=None, is_bool=False, name_hint=None, squeezed=None):
        if rows is None:
            rows = any(a.rows for a in args)
        if cols is None:
            cols = any(a.cols for a in args)
        if not self.track_squeeze:
            squeezed = False
        elif squeezed is None:
            squeezed = any(a.squeezed for a in args)
        key = (op, tuple(a.id for a in args), attrs, squeezed)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        value = Value(len(self.values), op, tuple(args), attrs, rows, cols, is_bool, squeezed, self._origin,
                      name_hint)
        self.values.append(value)
        self._memo[key] = value
        return value

    # ------------------------------------------------------------------ leaves
    def input(self, index: int, rows: bool, cols: bool, name: str, is_bool: bool = False) -> Value:
        return self._make("input", (), (("index", index),), rows, cols, is_bool, name_hint=name)

    def grad_output(self, index: int, rows: bool, cols: bool, name: str) -> Value:
        return self._make("grad_output", (), (("index", index),), rows, cols, name_hint=name)

    def const(self, value) -> Value:
        if isinstance(value, bool):
            return self._make("const", (), (("value", value),), False, False, is_bool=True)
        value = float(value)
        # -0.0 and 0.0 hash alike; keep them apart so x * -0.0 is not folded to x * 0.0
        return self._make("const", (), (("value", value), ("neg_zero", math.copysign(1.0, value) < 0)),
                          False, False)

    def ncols(self) -> Value:
        """The length of the column axis, as a number (the ``N`` of a mean)."""
        return self._make("ncols", (), (), False, False, name_hint="n_cols_f")

    def keep_mask(self, p: float, index: int) -> Value:
        """Bernoulli(1 - p) mask of dropout number ``index``, regenerated from the seed in backward."""
        return self._make("keep_mask", (), (("p", float(p)), ("index", index)), True, True, is_bool=True,
                          name_hint=f"keep{index}")

    # ------------------------------------------------------------------ helpers
    def _num(self, v) -> Value:
        return v if isinstance(v, Value) else self.const(v)

    @staticmethod
    def _is(v: Value, c: float) -> bool:
        return v.is_const and not v.is_bool and v.const_value == c

    def _binary(self, op: str, a, b):
        """``(a, b, folded)``: both operands as values, and ``op`` of them when both are constants
        (computed, or the op itself where folding fails, e.g. 1 / 0), else None."""
        a, b = self._num(a), self._num(b)
        if a.is_const and b.is_const:
            return a, b, self._fold(IR_OPS[op].fold, a, b) or self._make(op, (a, b))
        return a, b, None

    def _fold(self, fn, *args):
        try:
            return self.const(fn(*(a.const_value for a in args)))
        except (ZeroDivisionError, OverflowError, ValueError):
            return None

    # ------------------------------------------------------------------ arithmetic
    def add(self, a, b) -> Value:
        return self._add_or_sub("add", a, b)

    def sub(self, a, b) -> Value:
        return self._add_or_sub("sub", a, b)

    def _add_or_sub(self, op: str, a, b) -> Value:
        """``a + b`` or ``a - b``: x +- 0 is x, 0 + x is x, 0 - x is -x, x +- (-y) is x -+ y."""
        a, b, folded = self._binary(op, a, b)
        if folded is not None:
            return folded
        if self._is(b, 0.0):
            return a
        if self._is(a, 0.0):
            return b if op == "add" else self.neg(b)
        if b.op == "neg":
            return self._add_or_sub("sub" if op == "add" else "add", a, b.args[0])
        return self._make(op, (a, b))

    def mul(self, a, b) -> Value:
        a, b, folded = self._binary("mul", a, b)
        if folded is not None:
            return folded
        if a.is_const and not b.is_const:  # constants on the right: "x * 2.0"
            a, b = b, a
        if self._is(b, 1.0):
            return a
        if self._is(b, -1.0):
            return self.neg(a)
        if self._is(b, 0.0) and not b.attr("neg_zero"):
            return b
        if a.op == "neg" and b.op == "neg":
            return self.mul(a.args[0], b.args[0])
        if a.op == "neg":
            return self.neg(self.mul(a.args[0], b))
        if b.op == "neg":
            return self.neg(self.mul(a, b.args[0]))
        return self._make("mul", (a, b))

    def div(self, a, b) -> Value:
        a, b, folded = self._binary("div", a, b)
        if folded is not None:
            return folded
        if self._is(b, 1.0):
            return a
        if self._is(a, 0.0) and not a.attr("neg_zero"):
            return a
        return self._make("div", (a, b))

    def neg(self, a) -> Value:
        a = self._num(a)
        if a.is_const:
            return self.const(-a.const_value)
        if a.op == "neg":
            return a.args[0]
        return self._make("neg", (a,))

    def pow(self, a, b) -> Value:
        """``a ** b``. Constant integer exponents become multiplications (exact, and
        correct for negative bases); others use ``exp(b * log(a))``."""
        a, b = self._num(a), self._num(b)
        if a.is_const and b.is_const:
            return self._fold(lambda x, y: x ** y, a, b) or self.exp(self.mul(b, self.log(a)))
        if b.is_const:
            e = b.const_value
            if e == 0.0:
                return self.const(1.0)
            if e == 0.5:
                return self.sqrt(a)
            if e == -0.5:
                return self.rsqrt(a)
            if float(e).is_integer() and abs(e) <= 64:
                n = int(abs(e))
                result, base = None, a
                while n:  # binary exponentiation
                    if n & 1:
                        result = base if result is None else self.mul(result, base)
                    n >>= 1
                    if n:
                        base = self.mul(base, base)
                return self.div(1.0, result) if e < 0 else result
        return self.exp(self.mul(b, self.log(a)))

    def maximum(self, a, b) -> Value:
        return self._make("maximum", (self._num(a), self._num(b)))

    def minimum(self, a, b) -> Value:
        return self._make("minimum", (self._num(a), self._num(b)))

    def unary(self, op: str, a) -> Value:
        """A pointwise op of one operand (see :data:`~schedlang.lowering.ir_ops.IR_OPS`), folded on constants."""
        a = self._num(a)
        if a.is_const:
            folded = self._fold(IR_OPS[op].fold, a)
            if folded is not None:
                return folded
        return self._make(op, (a,))

    def exp(self, a): return self.unary("exp", a)
    def log(self, a): return self.unary("log", a)
    def sqrt(self, a): return self.unary("sqrt", a)
    def rsqrt(self, a): return self.unary("rsqrt", a)
    def tanh(self, a): return self.unary("tanh", a)
    def sigmoid(self, a): return self.unary("sigmoid", a)
    def erf(self, a): return self.unary("erf", a)
    def abs(self, a): return self.unary("abs", a)
    def relu(self, a): return self.unary("relu", a)

    def round_to(self, a, dtype_name: str) -> Value:
        """Round to a narrower float type and back (what an explicit ``.to(bf16)`` does)."""
        a = self._num(a)
        if a.is_const or a.op == "round" and a.attr("dtype") == dtype_name:
            return a
        return self._make("round", (a,), (("dtype", dtype_name),), is_bool=False)

    def row0(self, a) -> Value:
        """``a`` on row 0, zero elsewhere: injects the gradient of a row-invariant output once."""
        return self._make("row0", (self._num(a),), rows=True, cols=self._num(a).cols)

    def broadcast(self, a, rows: bool, cols: bool) -> Value:
        """``a`` materialized over more axes (the values repeat along them)."""
        a = self._num(a)
        return self._make("broadcast", (a,), (("rows", rows), ("cols", cols)), rows=rows or a.rows,
                          cols=cols or a.cols, is_bool=a.is_bool)

    def squeeze_if(self, a: Value, squeezed: bool) -> Value:
        """The same numbers marked as having (or not) their last dimension reduced away."""
        if a.squeezed == squeezed:
            return a
        if a.op == "alias" and a.args[0].squeezed == squeezed:
            return a.args[0]
        return self._make("alias", (a,), rows=a.rows, cols=a.cols, is_bool=a.is_bool, squeezed=squeezed)

    # ------------------------------------------------------------------ logic
    def compare(self, op: str, a, b) -> Value:
        assert op in COMPARE_OPS
        return self._make(op, (self._num(a), self._num(b)), is_bool=True)

    def where(self, cond, a, b) -> Value:
        cond, a, b = self._num(cond), self._num(a), self._num(b)
        if a is b:  # both branches equal: no select (stores broadcast to the output's axes)
            return a
        return self._make("where", (cond, a, b))

    # ------------------------------------------------------------------ reductions
    def rowsum(self, a) -> Value:
        """Sum over the column axis, keepdim. Identity for values without a column axis."""
        a = self._num(a)
        if not a.cols:
            return a
        return self._make("rowsum", (a,), rows=a.rows, cols=False)

    def rowmax(self, a, grad: bool = True) -> Value:
        """Max over the column axis, keepdim. ``grad=False`` marks a max that only shifts
        values for numerical stability (softmax): it gets no gradient, exactly."""
        a = self._num(a)
        if not a.cols:
            return a
        return self._make("rowmax", (a,), (("grad", grad),), rows=a.rows, cols=False)

    def rowmean(self, a) -> Value:
        a = self._num(a)
        if not a.cols:
            return a
        return self.div(self.rowsum(a), self.ncols())

    # ------------------------------------------------------------------ queries
    def reachable(self, sinks) -> list[Value]:
        """Values the sinks depend on, in build (topological) order."""
        seen: set[int] = set()
        stack = [s for s in sinks if s is not None]
        while stack:
            v = stack.pop()
            if v.id in seen:
                continue
            seen.add(v.id)
            stack.extend(v.args)
        return [v for v in self.values if v.id in seen]

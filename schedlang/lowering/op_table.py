"""How each FX operation maps onto the fused-kernel IR.

Three tables, keyed the way FX records a call:

* ``FUNCTIONS``: ``call_function`` targets (``operator.add``, ``torch.tanh``, ``F.gelu`` ...);
* ``METHODS``: ``call_method`` names (``"add"``, ``"mean"``, ``"to"`` ...);
* ``MODULES``: ``call_module`` leaf module types (``nn.GELU``, ``nn.LayerNorm`` ...), read
  through their attributes (``approximate``, ``eps``, ``weight``).

A handler receives a :class:`OpContext` and the call's arguments, where every tensor
argument has already become an IR :class:`~schedlang.lowering.ir.Value`, and returns the
Value of the result. Composite operations (GELU, LayerNorm, softmax, RMSNorm) are written
as primitive IR expressions, so their backward comes from the generic differentiation in
:mod:`schedlang.lowering.autodiff`. A handler that meets an argument it cannot express
calls :meth:`OpContext.unsupported`, which records the reason for the error report.

Example (what ``F.gelu(x, approximate="tanh")`` becomes)::

    inner = sqrt(2/pi) * (x + 0.044715 * x**3)
    y = 0.5 * x * (1 + tanh(inner))
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .ir import Value
from .ir_ops import IR_OPS, IROp

__all__ = ["FUNCTIONS", "METHODS", "MODULES", "OpContext", "Unsupported", "describe_target", "lookup"]

FUNCTIONS: dict = {}
METHODS: dict = {}
MODULES: dict = {}


class Unsupported(Exception):
    """Raised by a handler for an argument it cannot lower (collected, not shown to users as is)."""


class OpContext:
    """What a handler may ask about the node it lowers (filled in by the translator)."""

    def __init__(self, graph, node, translator):
        self.g = graph
        self.node = node
        self._translator = translator

    @property
    def out_dtype(self) -> torch.dtype:
        return self._translator.node_dtype(self.node)

    def ndim(self, value: Value) -> int:
        return self._translator.full_ndim - (1 if value.squeezed else 0)

    def tensor_meta(self, value: Value) -> tuple:
        """(shape, dtype) PyTorch gives the argument ``value`` of this node."""
        return self._translator.meta_of(self.node, value)

    def unsupported(self, reason: str):
        raise Unsupported(reason)

    def module_param(self, local_name: str) -> Value:
        """The Value of a parameter of the called leaf module (becomes a kernel input)."""
        return self._translator.attr_input(f"{self.node.target}.{local_name}")

    def new_dropout(self, p: float) -> Value:
        return self._translator.new_dropout(p)

    def cast(self, value: Value, dtype: torch.dtype) -> Value:
        return self._translator.cast(value, dtype)

    def last_dim(self, value: Value, dim, what: str):
        """Check that ``dim`` names the last dimension of ``value`` (the column axis)."""
        if isinstance(dim, (list, tuple)) and len(dim) == 1:
            dim = dim[0]
        ndim = self.ndim(value)
        if value.squeezed:
            self.unsupported(f"{what} over dim={dim!r} of a tensor whose last dimension was already reduced "
                             "without keepdim=True")
        if not isinstance(dim, int) or dim not in (-1, ndim - 1):
            self.unsupported(f"{what} over dim={dim!r}: only the last dimension (dim=-1) is fused")


def _register(table, *keys):
    def decorate(fn):
        for key in keys:
            if key is not None:
                table[key] = fn
        return fn
    return decorate


def _func(*targets):
    return _register(FUNCTIONS, *targets)


def _method(*names):
    return _register(METHODS, *names)


def _module(*types):
    return _register(MODULES, *types)


def lookup(node):
    """The handler for an FX node, or ``None`` when the op has no lowering."""
    if node.op == "call_function":
        return FUNCTIONS.get(node.target)
    if node.op == "call_method":
        return METHODS.get(node.target)
    return None


def describe_target(node, owner=None) -> str:
    """``torch.matmul``, ``Tensor.cumsum``, ``nn.Conv1d`` ... for error messages."""
    if node.op == "call_function":
        target = node.target
        module = getattr(target, "__module__", None) or ""
        name = getattr(target, "__name__", repr(target))
        if module in ("_operator", "operator"):
            return f"operator.{name}"
        if module.startswith("torch.nn.functional") or module == "torch._C._nn":
            return f"F.{name}"
        if module.startswith("torch") or module == "":
            return f"torch.{name}"
        return f"{module}.{name}"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module" and owner is not None:
        try:
            mod = owner.get_submodule(node.target)
            cls = type(mod)
            prefix = "nn." if cls.__module__.startswith("torch.nn") else f"{cls.__module__}."
            return f"{prefix}{cls.__name__}"
        except AttributeError:
            pass
    return f"{node.op} {node.target}"


# ---------------------------------------------------------------------------- arithmetic

def _number(ctx, v):
    if isinstance(v, Value):
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        ctx.unsupported(f"argument {v!r} of type {type(v).__name__} (expected a tensor or a number)")
    return v


@_func(operator.add, torch.add)
@_method("add", "__add__")
def _add(ctx, a, b, *, alpha=1):
    a, b = _number(ctx, a), _number(ctx, b)
    return ctx.g.add(a, b if alpha == 1 else ctx.g.mul(b, alpha))


@_method("__radd__")
def _radd(ctx, a, b):
    return ctx.g.add(_number(ctx, b), _number(ctx, a))


@_func(operator.sub, torch.sub, torch.subtract)
@_method("sub", "subtract", "__sub__")
def _sub(ctx, a, b, *, alpha=1):
    a, b = _number(ctx, a), _number(ctx, b)
    return ctx.g.sub(a, b if alpha == 1 else ctx.g.mul(b, alpha))


@_func(torch.rsub)
@_method("__rsub__")
def _rsub(ctx, a, b, *, alpha=1):
    a, b = _number(ctx, a), _number(ctx, b)
    return ctx.g.sub(b, a if alpha == 1 else ctx.g.mul(a, alpha))


@_func(operator.mul, torch.mul, torch.multiply)
@_method("mul", "multiply", "__mul__", "__rmul__")
def _mul(ctx, a, b):
    return ctx.g.mul(_number(ctx, a), _number(ctx, b))


@_func(operator.truediv, torch.div, torch.divide, torch.true_divide)
@_method("div", "divide", "true_divide", "__truediv__")
def _div(ctx, a, b, *, rounding_mode=None):
    if rounding_mode is not None:
        ctx.unsupported(f"division with rounding_mode={rounding_mode!r}")
    return ctx.g.div(_number(ctx, a), _number(ctx, b))


@_method("__rtruediv__")
def _rdiv(ctx, a, b):
    return ctx.g.div(_number(ctx, b), _number(ctx, a))


@_func(operator.neg, torch.neg, torch.negative)
@_method("neg", "negative", "__neg__")
def _neg(ctx, a):
    return ctx.g.neg(a)


@_func(operator.pow, torch.pow)
@_method("pow", "__pow__")
def _pow(ctx, a, b):
    return ctx.g.pow(_number(ctx, a), _number(ctx, b))


@_method("__rpow__")
def _rpow(ctx, a, b):
    return ctx.g.pow(_number(ctx, b), _number(ctx, a))


@_func(torch.square)
@_method("square")
def _square(ctx, a):
    return ctx.g.mul(a, a)


@_func(torch.reciprocal)
@_method("reciprocal")
def _reciprocal(ctx, a):
    return ctx.g.div(1.0, a)


def _one_to_one(op: IROp):
    """The handler of a PyTorch function that is exactly one IR op (listed in the op's entry)."""
    if op.category == "unary":
        def handler(ctx, a):
            return ctx.g.unary(op.name, a)
    else:
        def handler(ctx, a, b):
            return ctx.g.compare(op.name, _number(ctx, a), _number(ctx, b))
    handler.__name__ = f"_{op.name}"
    _func(*op.torch_functions)(handler)
    _method(*op.torch_methods)(handler)
    return handler


for _ir_op in IR_OPS.values():
    if _ir_op.torch_functions or _ir_op.torch_methods:
        _one_to_one(_ir_op)


@_func(torch.relu, F.relu)
@_method("relu")
def _relu(ctx, a, inplace=False):
    return ctx.g.relu(a)


@_func(torch.maximum)
@_method("maximum")
def _maximum(ctx, a, b):
    return ctx.g.maximum(a, b)


@_func(torch.minimum)
@_method("minimum")
def _minimum(ctx, a, b):
    return ctx.g.minimum(a, b)


@_func(torch.clamp, torch.clip)
@_method("clamp", "clip")
def _clamp(ctx, a, min=None, max=None):
    # written with selects so the gradient passes where min <= x <= max, as in PyTorch
    g = ctx.g
    out = a
    if min is not None:
        out = g.where(g.compare("lt", out, _number(ctx, min)), _number(ctx, min), out)
    if max is not None:
        out = g.where(g.compare("gt", out, _number(ctx, max)), _number(ctx, max), out)
    return out


@_func(torch.where)
@_method("where")
def _where(ctx, cond, a=None, b=None):
    if a is None or b is None:
        ctx.unsupported("torch.where with one argument (returns indices)")
    if not (isinstance(cond, Value) and cond.is_bool):
        ctx.unsupported("torch.where whose condition is not a boolean tensor")
    return ctx.g.where(cond, _number(ctx, a), _number(ctx, b))


# ---------------------------------------------------------------------------- activations

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)


def gelu(ctx, x, approximate="none"):
    """GELU: ``0.5 x (1 + erf(x / sqrt 2))``, or the tanh form ``0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))``."""
    g = ctx.g
    if approximate == "tanh":
        inner = g.mul(g.add(x, g.mul(g.mul(g.mul(x, x), x), 0.044715)), _SQRT_2_OVER_PI)
        return g.mul(g.mul(x, 0.5), g.add(g.tanh(inner), 1.0))
    if approximate != "none":
        ctx.unsupported(f"gelu with approximate={approximate!r} (valid: 'none', 'tanh')")
    return g.mul(g.mul(x, 0.5), g.add(g.erf(g.mul(x, _INV_SQRT_2)), 1.0))


_func(F.gelu)(gelu)


@_method("gelu")
def _gelu_method(ctx, x, approximate="none"):
    return gelu(ctx, x, approximate)


@_func(F.silu)
def _silu(ctx, x, inplace=False):
    return ctx.g.mul(x, ctx.g.sigmoid(x))


@_func(F.dropout)
def _dropout(ctx, x, p=0.5, training=True, inplace=False):
    return dropout(ctx, x, p, training)


def dropout(ctx, x, p, training):
    """Identity in eval mode or with p=0; otherwise ``where(keep, x / (1 - p), 0)`` with a
    Philox mask regenerated from the same seed in the backward kernel."""
    if not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        ctx.unsupported(f"dropout probability p={p!r} (expected a number in [0, 1])")
    if not training or p == 0:
        return x
    if p == 1:
        return ctx.g.mul(x, 0.0)
    keep = ctx.new_dropout(float(p))
    return ctx.g.where(keep, ctx.g.mul(x, 1.0 / (1.0 - p)), 0.0)


# ---------------------------------------------------------------------------- row reductions

def _reduce(ctx, x, dim, keepdim, what, dtype=None):
    if dim is None:
        ctx.unsupported(f"{what} over all dimensions (only the last dimension, dim=-1, is fused)")
    ctx.last_dim(x, dim, what)
    if dtype is not None:
        x = ctx.cast(x, dtype)
    return x


@_func(torch.sum)
@_method("sum")
def _sum(ctx, x, dim=None, keepdim=False, *, dtype=None):
    x = _reduce(ctx, x, dim, keepdim, "sum", dtype)
    return ctx.g.squeeze_if(ctx.g.rowsum(x), not keepdim)


@_func(torch.mean)
@_method("mean")
def _mean(ctx, x, dim=None, keepdim=False, *, dtype=None):
    x = _reduce(ctx, x, dim, keepdim, "mean", dtype)
    return ctx.g.squeeze_if(ctx.g.rowmean(x), not keepdim)


@_func(torch.amax)
@_method("amax")
def _amax(ctx, x, dim=(), keepdim=False):
    x = _reduce(ctx, x, None if dim == () else dim, keepdim, "amax")
    return ctx.g.squeeze_if(ctx.g.rowmax(x, grad=True), not keepdim)


def softmax(ctx, x, dim, dtype=None, log=False):
    """``exp(x - max) / sum(exp(x - max))`` over the last dimension. The max only shifts
    the exponent for range: it cancels out, so it is built without a gradient."""
    what = "log_softmax" if log else "softmax"
    if dim is None:
        ctx.unsupported(f"{what} with dim=None (implicit dimension); pass dim=-1")
    ctx.last_dim(x, dim, what)
    if dtype is not None:
        x = ctx.cast(x, dtype)
    g = ctx.g
    shifted = g.sub(x, g.rowmax(x, grad=False))
    if log:
        return g.sub(shifted, g.log(g.rowsum(g.exp(shifted))))
    e = g.exp(shifted)
    return g.div(e, g.rowsum(e))


@_func(F.softmax, torch.softmax, torch.special.softmax)
@_method("softmax")
def _softmax(ctx, x, dim=None, _stacklevel=3, dtype=None):
    return softmax(ctx, x, dim, dtype)


@_func(F.log_softmax, torch.log_softmax, torch.special.log_softmax)
@_method("log_softmax")
def _log_softmax(ctx, x, dim=None, _stacklevel=3, dtype=None):
    return softmax(ctx, x, dim, dtype, log=True)


def _normalized_shape_ok(ctx, x, normalized_shape, what):
    shape = tuple(normalized_shape) if isinstance(normalized_shape, (list, tuple, torch.Size)) else (
        normalized_shape,)
    if len(shape) != 1:
        ctx.unsupported(f"{what} over normalized_shape={tuple(shape)}: only the last dimension is fused")
    ctx.last_dim(x, -1, what)


def layer_norm(ctx, x, weight, bias, eps):
    """``(x - mean) * rsqrt(var + eps) * weight + bias``, statistics over the last dimension
    (biased variance, as F.layer_norm)."""
    g = ctx.g
    centered = g.sub(x, g.rowmean(x))
    rstd = g.rsqrt(g.add(g.rowmean(g.mul(centered, centered)), float(eps)))
    y = g.mul(centered, rstd)
    if weight is not None:
        y = g.mul(y, weight)
    if bias is not None:
        y = g.add(y, bias)
    return y


@_func(F.layer_norm)
def _layer_norm(ctx, x, normalized_shape, weight=None, bias=None, eps=1e-5):
    _normalized_shape_ok(ctx, x, normalized_shape, "layer_norm")
    return layer_norm(ctx, x, weight, bias, eps)


def rms_norm(ctx, x, weight, eps):
    """``x * rsqrt(mean(x^2) + eps) * weight``; eps=None means the input dtype's epsilon."""
    g = ctx.g
    if eps is None:
        eps = torch.finfo(ctx.out_dtype).eps
    y = g.mul(x, g.rsqrt(g.add(g.rowmean(g.mul(x, x)), float(eps))))
    return y if weight is None else g.mul(y, weight)


if hasattr(F, "rms_norm"):
    @_func(F.rms_norm)
    def _rms_norm(ctx, x, normalized_shape, weight=None, eps=None):
        _normalized_shape_ok(ctx, x, normalized_shape, "rms_norm")
        return rms_norm(ctx, x, weight, eps)


# ---------------------------------------------------------------------------- casts and views

def _cast_to_node_dtype(ctx, x, *args, **kwargs):
    return ctx.cast(x, ctx.out_dtype)


for _name in ("to", "type", "type_as", "float", "half", "bfloat16", "double"):
    _method(_name)(_cast_to_node_dtype)


@_method("contiguous", "clone")
@_func(torch.clone)
def _identity(ctx, x, *args, **kwargs):
    return x


@_method("unsqueeze")
@_func(torch.unsqueeze)
def _unsqueeze(ctx, x, dim):
    # only undoing a reduction without keepdim: x.sum(-1).unsqueeze(-1)
    if x.squeezed and dim in (-1, ctx.ndim(x)):
        return ctx.g.squeeze_if(x, False)
    ctx.unsupported(f"unsqueeze(dim={dim!r}) other than restoring a reduced last dimension")


# ---------------------------------------------------------------------------- shape queries
# x.dtype, x.shape[-1], x.size(-1), x.dim(): Python values known once the shapes are (the
# kernels are specialized per shape), so traced code like LlamaRMSNorm's
# ``hidden.to(input_dtype)`` or ``F.layer_norm(x, (x.shape[-1],))`` lowers.

def _python_value(fn):
    fn.returns_python = True
    return fn


@_func(getattr)
@_python_value
def _getattr(ctx, obj, name, *default):
    if isinstance(obj, Value):
        shape, dtype = ctx.tensor_meta(obj)
        if name == "dtype":
            return dtype
        if name == "shape":
            return torch.Size(shape)
        if name == "ndim":
            return len(shape)
        ctx.unsupported(f"tensor attribute {name!r} (dtype, shape and ndim are known at lowering time)")
    return getattr(obj, name, *default)


@_func(operator.getitem)
@_python_value
def _getitem(ctx, obj, index):
    if isinstance(obj, Value):
        ctx.unsupported("indexing a tensor (only whole tensors are fused)")
    return obj[index]


@_method("size")
@_python_value
def _size(ctx, x, dim=None):
    shape = torch.Size(ctx.tensor_meta(x)[0])
    return shape if dim is None else shape[dim]


@_method("dim")
@_python_value
def _dim(ctx, x):
    return len(ctx.tensor_meta(x)[0])


# ---------------------------------------------------------------------------- leaf modules

@_module(nn.GELU)
def _gelu_module(ctx, mod, x):
    return gelu(ctx, x, getattr(mod, "approximate", "none"))


@_module(nn.ReLU)
def _relu_module(ctx, mod, x):
    return ctx.g.relu(x)


@_module(nn.Tanh)
def _tanh_module(ctx, mod, x):
    return ctx.g.tanh(x)


@_module(nn.Sigmoid)
def _sigmoid_module(ctx, mod, x):
    return ctx.g.sigmoid(x)


@_module(nn.SiLU)
def _silu_module(ctx, mod, x):
    return ctx.g.mul(x, ctx.g.sigmoid(x))


@_module(nn.Identity)
def _identity_module(ctx, mod, x, *args, **kwargs):
    return x


@_module(nn.Dropout)
def _dropout_module(ctx, mod, x):
    return dropout(ctx, x, mod.p, mod.training)


@_module(nn.Softmax)
def _softmax_module(ctx, mod, x):
    return softmax(ctx, x, mod.dim)


@_module(nn.LogSoftmax)
def _log_softmax_module(ctx, mod, x):
    return softmax(ctx, x, mod.dim, log=True)


@_module(nn.LayerNorm)
def _layer_norm_module(ctx, mod, x):
    _normalized_shape_ok(ctx, x, mod.normalized_shape, "nn.LayerNorm")
    weight = ctx.module_param("weight") if getattr(mod, "weight", None) is not None else None
    bias = ctx.module_param("bias") if getattr(mod, "bias", None) is not None else None
    return layer_norm(ctx, x, weight, bias, mod.eps)


if hasattr(nn, "RMSNorm"):
    @_module(nn.RMSNorm)
    def _rms_norm_module(ctx, mod, x):
        _normalized_shape_ok(ctx, x, mod.normalized_shape, "nn.RMSNorm")
        weight = ctx.module_param("weight") if getattr(mod, "weight", None) is not None else None
        return rms_norm(ctx, x, weight, mod.eps)


def module_handler(mod):
    """The handler for a leaf module instance (exact type match: subclasses may change forward)."""
    return MODULES.get(type(mod))

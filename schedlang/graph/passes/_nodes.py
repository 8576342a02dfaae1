"""Reading FX nodes: which op a node is, its arguments by name, and what is known of its shape.

The horizontal rules work on graphs from ``torch.fx.symbolic_trace`` (no shapes) as well
as on graphs whose nodes carry shapes (``node.meta["tensor_meta"]`` from
``torch.fx.passes.shape_prop.ShapeProp``, ``node.meta["val"]`` from fake-tensor tracing, or
``node.meta[EXAMPLE_META]``, set for one run of the rules from ``example_inputs``). Without
shapes they reason from structure: the pieces of one ``unbind`` have one shape, a layer
norm keeps its input's shape, and so on (:func:`shape_key`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Dict, Hashable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

from ...module_record import module_record

__all__ = [
    "Piece", "SplitSpec", "arg", "split_spec", "piece_of", "tensor_shape", "tensor_dtype", "num_pieces",
    "shape_key", "is_call", "module_of", "plain_module", "NUM_PIECES_META", "EXAMPLE_META", "settled_size",
    "every_piece_once",
]

#: node.meta key under which the rules record how many pieces a split/unbind they create has
NUM_PIECES_META = "schedlang_num_pieces"
#: node.meta key of the fake value a node took on ``example_inputs`` (present only while the rules run)
EXAMPLE_META = "schedlang_example_value"


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a call node, given positionally at ``index`` or by keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def is_call(node: fx.Node, functions: Sequence[Any] = (), methods: Sequence[str] = ()) -> bool:
    """Whether ``node`` calls one of ``functions`` (call_function) or ``methods`` (call_method)."""
    if node.op == "call_function":
        return any(node.target is f for f in functions)
    if node.op == "call_method":
        return node.target in methods
    return False


def module_of(gm: Any, node: fx.Node) -> Optional[nn.Module]:
    """The module a call_module node calls (None for other nodes or a missing target).

    ``gm`` is the GraphModule, or anything with its ``get_submodule`` (a rewrite context).
    """
    if node.op != "call_module":
        return None
    try:
        return gm.get_submodule(node.target)
    except AttributeError:
        return None


def plain_module(module: nn.Module, kind: type) -> bool:
    """Whether ``module`` is exactly ``kind`` with nothing attached that a rewrite would lose.

    Subclasses (they may override ``forward``), modules with hooks, sharded modules,
    parametrized modules and modules with sync points stay as they are.
    """
    if type(module) is not kind:
        return False
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_state_dict_hooks", "_forward_hooks_with_kwargs")
    if any(getattr(module, h, None) for h in hooks if h != "_forward_hooks_with_kwargs"):
        return False
    record = module_record(module)
    if record.shards or record.checkpointed or record.syncs:
        return False
    if any(name.startswith("_schedlang_") for name in module._modules):  # any other child schedlang added
        return False
    return True


# --------------------------------------------------------------------------- split / unbind
_SPLIT_FUNCTIONS = (torch.split, torch.functional.split, torch.Tensor.split)
_UNBIND_FUNCTIONS = (torch.unbind, torch.Tensor.unbind)


@dataclass(frozen=True)
class SplitSpec:
    """A node that cuts ``base`` into pieces along ``dim``.

    ``kind`` is "split" (``sizes`` is an int or a tuple of ints) or "unbind" (``sizes`` None).
    """

    node: fx.Node
    kind: str
    base: fx.Node
    dim: int
    sizes: Any


def split_spec(node: fx.Node) -> Optional[SplitSpec]:
    """Describe ``node`` if it is ``torch.split``/``Tensor.split``/``split_with_sizes``/``unbind``."""
    if not isinstance(node, fx.Node):
        return None
    if is_call(node, _SPLIT_FUNCTIONS, ("split", "split_with_sizes")):
        base = node.args[0] if node.args else node.kwargs.get("tensor", node.kwargs.get("self"))
        sizes = arg(node, 1, "split_size_or_sections", None)
        if sizes is None:
            sizes = node.kwargs.get("split_size", node.kwargs.get("split_sizes"))
        dim = arg(node, 2, "dim", 0)
        if not isinstance(base, fx.Node) or not isinstance(dim, int):
            return None
        if isinstance(sizes, (list, tuple)) and all(type(s) is int for s in sizes):
            sizes = tuple(sizes)
        elif type(sizes) is not int or sizes <= 0:
            return None
        return SplitSpec(node, "split", base, dim, sizes)
    if is_call(node, _UNBIND_FUNCTIONS, ("unbind",)):
        base = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
        dim = arg(node, 1, "dim", 0)
        if not isinstance(base, fx.Node) or not isinstance(dim, int):
            return None
        return SplitSpec(node, "unbind", base, dim, None)
    return None


def num_pieces(spec: SplitSpec) -> Optional[int]:
    """How many pieces ``spec`` makes, when that is known without running the graph."""
    known = spec.node.meta.get(NUM_PIECES_META)
    if known is not None:
        return known
    if spec.kind == "split" and isinstance(spec.sizes, tuple):
        return len(spec.sizes)
    shape = tensor_shape(spec.base)
    if shape is None or not -len(shape) <= spec.dim < len(shape):
        return None
    length = shape[spec.dim]
    if spec.kind == "unbind":
        return length
    return max(1, -(-length // spec.sizes))


@dataclass(frozen=True)
class Piece:
    """``getitem(split_node, index)``: piece ``index`` of a split or unbind.

    ``offset`` and ``size`` (along ``spec.dim``) are known for splits when the piece's extent
    follows from the arguments; ``size`` is None for an int split's possibly shorter last piece.
    """

    node: fx.Node
    spec: SplitSpec
    index: int
    offset: Optional[int]
    size: Optional[int]


def piece_of(node: Any) -> Optional[Piece]:
    """Describe ``node`` if it is ``operator.getitem`` of a split/unbind with a constant index."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not operator.getitem:
        return None
    if len(node.args) != 2 or type(node.args[1]) is not int:
        return None
    spec = split_spec(node.args[0])
    if spec is None:
        return None
    index = node.args[1]
    count = num_pieces(spec)
    if index < 0:
        if count is None:
            return None
        index += count
    if spec.kind == "unbind":
        return Piece(node, spec, index, None, None)
    if isinstance(spec.sizes, tuple):
        if not 0 <= index < len(spec.sizes):
            return None
        return Piece(node, spec, index, sum(spec.sizes[:index]), spec.sizes[index])
    size: Optional[int] = spec.sizes
    shape = tensor_shape(spec.base)
    if shape is not None and -len(shape) <= spec.dim < len(shape):
        size = min(spec.sizes, shape[spec.dim] - index * spec.sizes)
    elif count is not None and index == count - 1:
        size = None
    elif count is None and index >= _highest_index_used(spec.node):
        size = None  # possibly the last piece, which may be shorter
    return Piece(node, spec, index, index * spec.sizes, size)


def settled_size(piece: Piece, last_dim: Optional[int] = None) -> Optional[int]:
    """The size of ``piece`` along its split dim, when it is known.

    ``last_dim`` is a size the consuming operator requires of the piece's last dimension (the
    normalized size of a layer norm, ``in_features`` of a linear): for a split along ``-1`` it
    settles the size of an int split's possibly shorter last piece, since the operator would
    reject a shorter one. None for an unbind, and for a last piece nothing settles.
    """
    if piece.size is not None or piece.spec.kind == "unbind":
        return piece.size
    return last_dim if piece.spec.dim == -1 else None


def _highest_index_used(split_node: fx.Node) -> int:
    """Highest constant index taken from ``split_node`` in the graph (pieces below it are whole)."""
    used = [u.args[1] for u in split_node.users
            if u.op == "call_function" and u.target is operator.getitem and type(u.args[1]) is int]
    return max(used, default=-1)


# --------------------------------------------------------------------------- shapes
def _meta_tensor(node: Any):
    if not isinstance(node, fx.Node):
        return None
    example = node.meta.get(EXAMPLE_META)
    if isinstance(example, torch.Tensor):
        return example
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape") and hasattr(tm, "dtype"):
        return tm
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val
    return None


def tensor_shape(node: Any) -> Optional[Tuple[int, ...]]:
    """Static shape of ``node``'s value from its metadata, if recorded (and free of symbols)."""
    t = _meta_tensor(node)
    if t is None:
        return None
    try:
        return tuple(int(s) for s in t.shape)
    except (TypeError, ValueError):
        return None


def tensor_dtype(node: Any) -> Optional[torch.dtype]:
    t = _meta_tensor(node)
    return None if t is None else t.dtype


_POINTWISE_SAME_SHAPE = (torch.tanh, torch.relu, torch.sigmoid, F.relu, F.gelu, F.silu, F.tanh, F.sigmoid,
                         torch.nn.functional.layer_norm, torch.neg, torch.exp, F.dropout)
_POINTWISE_METHODS = ("tanh", "relu", "sigmoid", "neg", "exp", "contiguous", "clone")
_SAME_SHAPE_MODULES = (nn.LayerNorm, nn.Tanh, nn.ReLU, nn.Sigmoid, nn.GELU, nn.SiLU, nn.Identity, nn.Dropout)


def shape_key(node: Any, gm: Any = None, last_dim: Optional[int] = None,
              _memo: Optional[Dict[fx.Node, Hashable]] = None) -> Hashable:
    """A key such that two nodes with equal keys hold tensors of one shape and dtype.

    Unequal keys say nothing (the shapes may still agree). ``last_dim`` is a size the
    caller's operator requires of the last dimension (``in_features`` of a linear, the
    normalized size of a layer norm): it settles the size of an int split's last piece.
    """
    if not isinstance(node, fx.Node):
        return ("const", id(node))
    shape = tensor_shape(node)
    if shape is not None:
        return ("shape", shape, tensor_dtype(node))
    memo = {} if _memo is None else _memo
    if node in memo:
        return memo[node]
    memo[node] = ("node", node)  # guards against cycles while recursing
    key: Hashable = ("node", node)
    piece = piece_of(node)
    if piece is not None:
        spec = piece.spec
        if spec.kind == "unbind":
            key = ("unbind", spec.node)
        elif piece.size is not None:
            key = ("split", spec.node, piece.size)
        elif last_dim is not None and spec.dim == -1:
            key = ("split", spec.node, last_dim)
    elif node.op in ("call_function", "call_method") and node.args:
        same = (node.op == "call_function" and any(node.target is f for f in _POINTWISE_SAME_SHAPE)) or (
            node.op == "call_method" and node.target in _POINTWISE_METHODS)
        if same and isinstance(node.args[0], fx.Node):
            inner = shape_key(node.args[0], gm, last_dim, memo)
            if inner[0] != "node":
                key = inner
    elif node.op == "call_module" and gm is not None and len(node.args) == 1:
        module = module_of(gm, node)
        if isinstance(module, _SAME_SHAPE_MODULES) and isinstance(node.args[0], fx.Node):
            inner = shape_key(node.args[0], gm, last_dim, memo)
            if inner[0] != "node":
                key = inner
        elif isinstance(module, nn.Linear) and isinstance(node.args[0], fx.Node):
            inner = shape_key(node.args[0], gm, module.in_features, memo)
            if inner[0] != "node":
                key = ("linear", inner, module.out_features, module.weight.dtype)
    memo[node] = key
    return key


def every_piece_once(inputs) -> bool:
    """Whether ``inputs`` are pieces ``0 .. n-1`` of one int split, each once (so piece ``n-1`` is its last
    used piece, and the pieces tile the start of the split's input)."""
    pieces = [piece_of(x) for x in inputs]
    if any(p is None for p in pieces) or len({p.spec.node for p in pieces}) != 1:
        return False
    spec = pieces[0].spec
    if spec.kind != "split" or type(spec.sizes) is not int:
        return False
    return sorted(p.index for p in pieces) == list(range(len(pieces)))

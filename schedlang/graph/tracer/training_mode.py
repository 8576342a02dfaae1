"""Traced graphs and the training mode.

Tracing freezes ``self.training``: ``F.dropout(x, p, self.training)`` is recorded with
``training=True``, and ``p if self.training else 0.0`` (transformers' attention) keeps the
branch it took. A graph traced in training mode and then run after ``model.eval()`` would
keep dropping activations, silently. So ``trace_module`` traces a second time in the other
mode and compares the graphs:

* the same graph (no mode read, or only as dropout with ``p=0``, like LLaMA's attention): kept;
* the same nodes, with other constants passed to some calls (GPT-2's and BERT's attention with
  ``dropout > 0``, functional dropout): those calls are rewritten to read the mode when they
  run (:func:`follow_training_mode`), so the graph follows ``train()`` / ``eval()``;
* anything else (a branch on ``self.training`` that adds or removes operations): a forward
  pre-hook (:class:`TrainingModeGuard`) refuses to run the graph in the mode it was not traced in.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ...errors import TraceError
from .traced_module import ModuleAttributes, _lookup

logger = logging.getLogger("schedlang.graph.tracer")


def _mode(training: bool) -> str:
    return "training" if training else "eval"


class TrainingModeGuard:
    """Forward pre-hook of a traced module whose graph was fixed to one training mode.

    A class (not a closure) so that deep copies and pickles of the traced module keep it.
    """

    def __init__(self, where: str, traced_training: bool):
        self.where = where
        self.traced_training = traced_training

    def __call__(self, module: nn.Module, args) -> None:
        if module.training == self.traced_training:
            return None
        traced, now = _mode(self.traced_training), _mode(module.training)
        raise TraceError(
            f"{self.where}: this graph was traced in {traced} mode and depends on the mode (a branch on "
            f"self.training was fixed while tracing), so it cannot run in {now} mode; call "
            f"{'.train()' if self.traced_training else '.eval()'} on the model first, or trace this module in "
            f"{now} mode (model.{'train' if not self.traced_training else 'eval'}() before .trace())")


@contextlib.contextmanager
def _flipped_mode(module: nn.Module) -> Iterator[None]:
    """``module`` and its children in the other training mode, each flag restored afterwards (a model may
    hold modules in different modes on purpose)."""
    flags = [(m, m.training) for m in module.modules()]
    module.train(not module.training)
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


#: functions whose ``training`` argument changes nothing when their ``p`` is 0
_DROPOUTS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
             torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout)


def _node_signature(node: fx.Node) -> Tuple:
    args, kwargs = node.args, dict(node.kwargs)
    if node.op == "call_function" and node.target in _DROPOUTS:
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        if p == 0:
            # transformers passes training=self.training with p=0.0 in eval (LLaMA's attention: always 0.0);
            # an identity either way, so this node does not tie the graph to a mode
            args, kwargs = args[:1], {}
    return node.op, node.name, str(node.target), repr(args), repr(sorted(kwargs.items()))


def _graph_codes(gm: nn.Module) -> Dict[str, List[Tuple]]:
    """Each graph of ``gm`` by qualified name, as what its nodes compute."""
    return {name: [_node_signature(n) for n in m.graph.nodes] for name, m in gm.named_modules()
            if isinstance(m, fx.GraphModule)}


def _has_guard(module: nn.Module) -> bool:
    return any(isinstance(h, TrainingModeGuard) for h in module._forward_pre_hooks.values())


def guard_training_mode(module: nn.Module, gm: fx.GraphModule, trace_again: Callable[[], fx.GraphModule],
                        where: str) -> None:
    """Make every graph of ``gm`` (``module`` traced in its current mode) that differs when traced in the
    other mode follow the mode (:func:`follow_training_mode`) where the two traces differ only in the
    constants of some calls, and give it a :class:`TrainingModeGuard` otherwise. ``trace_again`` traces
    ``module`` once more, as ``gm`` was."""
    traced_training = module.training
    codes = _graph_codes(gm)
    try:
        with _flipped_mode(module):
            other_gm = trace_again()
        other = _graph_codes(other_gm)
    except Exception as e:  # the other mode does not even trace: this graph can only serve the traced one
        logger.debug("%s: tracing in %s mode failed (%s); the graph is kept to %s mode", where,
                     _mode(not traced_training), e, _mode(traced_training))
        other_gm, other = None, {}
    for name, code in codes.items():
        if other.get(name) == code:
            continue
        graph_module = gm.get_submodule(name) if name else gm
        if _has_guard(graph_module):  # retraced: the graph it came from was fixed to a mode already
            continue
        path = ".".join(p for p in (where if where != "<root>" else "", name) if p) or "<root>"
        if name in other and follow_training_mode(graph_module, other_gm.get_submodule(name) if name else other_gm,
                                                  traced_training):
            logger.debug("%s: the traced graph's calls now take the constants of the mode they run in", path)
            continue
        graph_module.register_forward_pre_hook(TrainingModeGuard(path, traced_training))
        logger.debug("%s: the traced graph depends on the training mode; it runs only in %s mode", path,
                     _mode(traced_training))


# ------------------------------------------------------------------------------ graphs that follow the mode
class _Input:
    """Where the i-th graph input of a :class:`ModeDependentCall` goes in a recorded call."""

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<input {self.index}>"


def _fill(template: Any, inputs: Tuple) -> Any:
    if isinstance(template, _Input):
        return inputs[template.index]
    if isinstance(template, (tuple, list)):
        return type(template)(_fill(t, inputs) for t in template)
    if isinstance(template, dict):
        return {k: _fill(v, inputs) for k, v in template.items()}
    if isinstance(template, slice):
        return slice(_fill(template.start, inputs), _fill(template.stop, inputs), _fill(template.step, inputs))
    return template


class ModeDependentCall(nn.Module):
    """A function call that tracing recorded with other constants in training mode than in eval mode, and
    that makes the call of the mode it runs in.

    transformers passes ``dropout=p if self.training else 0.0`` to its attention kernels, and a module
    passed to a leaf function is recorded as a snapshot with its ``training`` flag
    (:class:`~schedlang.graph.tracer.ModuleAttributes`). Each recorded call is ``(args, kwargs)`` with the
    graph values this node receives marked by position; a child module, so ``train()`` / ``eval()`` on the
    model reach it.

    Example: ``ModeDependentCall(sdpa_attention_forward, training_call, eval_call)(q, k, v, mask)``.
    """

    def __init__(self, target: Callable, training_call: Tuple[Tuple, Dict[str, Any]],
                 eval_call: Tuple[Tuple, Dict[str, Any]]):
        super().__init__()
        self.target = target
        self.training_call = training_call
        self.eval_call = eval_call

    def call_for(self, inputs: Tuple) -> Tuple[Tuple, Dict[str, Any]]:
        """The ``(args, kwargs)`` this module passes its target in its current mode, given its inputs."""
        args, kwargs = self.training_call if self.training else self.eval_call
        return _fill(args, inputs), _fill(kwargs, inputs)

    def forward(self, *inputs):
        args, kwargs = self.call_for(inputs)
        return self.target(*args, **kwargs)

    def extra_repr(self) -> str:
        return getattr(self.target, "__qualname__", repr(self.target))


#: dropout functions and the module that applies each in the module's own training mode
_DROPOUT_MODULES = {F.dropout: nn.Dropout, torch.dropout: nn.Dropout, F.dropout1d: nn.Dropout1d,
                    F.dropout2d: nn.Dropout2d, F.dropout3d: nn.Dropout3d, F.alpha_dropout: nn.AlphaDropout,
                    torch.alpha_dropout: nn.AlphaDropout, F.feature_alpha_dropout: nn.FeatureAlphaDropout,
                    torch.feature_alpha_dropout: nn.FeatureAlphaDropout}
#: the module types of _DROPOUT_MODULES that take ``inplace``
_INPLACE_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


def _dropout_call(node: fx.Node) -> Optional[Tuple[Any, float, bool, bool]]:
    """(input, p, training, inplace) of a dropout call node with literal arguments, else None."""
    fn = node.target
    try:
        if fn in (torch.dropout, torch.alpha_dropout, torch.feature_alpha_dropout):
            bound = dict(zip(("input", "p", "train"), node.args), **node.kwargs)
            x, p, training, inplace = bound["input"], bound["p"], bound["train"], False
        else:
            bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
            bound.apply_defaults()
            x, p, training = bound.arguments["input"], bound.arguments["p"], bound.arguments["training"]
            inplace = bound.arguments.get("inplace", False)
    except (KeyError, TypeError, ValueError):
        return None
    if isinstance(p, fx.Node) or isinstance(training, fx.Node) or isinstance(inplace, fx.Node):
        return None
    return x, p, bool(training), bool(inplace)


def _as_dropout_module(node: fx.Node, other: fx.Node, traced_training: bool) -> Optional[nn.Module]:
    """An ``nn.Dropout``-like module for a dropout node that drops in training mode and not in eval, else None."""
    module_type = _DROPOUT_MODULES.get(node.target) if node.target is other.target else None
    if module_type is None:
        return None
    training_node, eval_node = (node, other) if traced_training else (other, node)
    in_training, in_eval = _dropout_call(training_node), _dropout_call(eval_node)
    if in_training is None or in_eval is None or not isinstance(in_training[0], fx.Node) \
            or not isinstance(in_eval[0], fx.Node) or in_training[0].name != in_eval[0].name:
        return None
    _, p, training, inplace = in_training
    _, p_eval, training_eval, inplace_eval = in_eval
    if not training or (training_eval and p_eval != 0) or inplace != inplace_eval:
        return None
    if inplace and module_type not in _INPLACE_DROPOUTS:
        return None
    return module_type(p, inplace) if module_type in _INPLACE_DROPOUTS else module_type(p)


def _recorded_call(node: fx.Node, owner: nn.Module, inputs: List[fx.Node]) -> Tuple[Tuple, Dict[str, Any]]:
    """``node``'s arguments as a call template: graph values become :class:`_Input` marks (numbered in
    ``inputs``, appended in order of first use), snapshots of modules stay as recorded."""
    def mark(a):
        if a.op == "get_attr":
            value = _lookup(owner, a.target)
            if isinstance(value, ModuleAttributes):
                return value
        if a not in inputs:
            inputs.append(a)
        return _Input(inputs.index(a))

    args = fx.node.map_arg(node.args, mark)
    kwargs = fx.node.map_arg(node.kwargs, mark)
    return args, dict(kwargs)


def _free_name(owner: nn.Module, base: str) -> str:
    name, i = base, 0
    while hasattr(owner, name):
        i += 1
        name = f"{base}_{i}"
    return name


def follow_training_mode(gm: fx.GraphModule, other: fx.GraphModule, traced_training: bool) -> bool:
    """Rewrite ``gm``'s graph so that it follows the training mode, given ``other``: the same module traced in
    the other mode. Possible where the two graphs have the same nodes and differ only in constants passed to
    function calls: a dropout that drops only in training mode becomes its ``nn.Dropout``-like module, and
    any other such call a :class:`ModeDependentCall`; both read ``self.training`` when they run. Returns
    False, and leaves ``gm`` as it was, where the graphs differ in anything else."""
    nodes, other_nodes = list(gm.graph.nodes), list(other.graph.nodes)
    if len(nodes) != len(other_nodes):
        return False
    plans = []
    for node, other_node in zip(nodes, other_nodes):
        if _node_signature(node) == _node_signature(other_node):
            continue
        if node.op != "call_function" or other_node.op != "call_function" or node.name != other_node.name \
                or node.target is not other_node.target:
            return False
        dropout = _as_dropout_module(node, other_node, traced_training)
        if dropout is not None:
            plans.append((node, dropout, (_dropout_call(node)[0],)))
            continue
        inputs: List[fx.Node] = []
        this_call = _recorded_call(node, gm, inputs)
        other_inputs: List[fx.Node] = []
        other_call = _recorded_call(other_node, other, other_inputs)
        if [n.name for n in other_inputs] != [n.name for n in inputs]:
            return False
        training_call, eval_call = (this_call, other_call) if traced_training else (other_call, this_call)
        plans.append((node, ModeDependentCall(node.target, training_call, eval_call), tuple(inputs)))
    if not plans:
        return False
    for node, replacement, inputs in plans:
        name = _free_name(gm, f"{node.name}_by_mode")
        gm.add_module(name, replacement.train(gm.training))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, inputs)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    for node in list(gm.graph.nodes):  # module snapshots no call reads any more
        if node.op == "get_attr" and not node.users and isinstance(_lookup(gm, node.target), ModuleAttributes):
            gm.graph.erase_node(node)
    gm.recompile()
    return True

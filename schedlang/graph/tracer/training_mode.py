"""The guard on the training mode a graph was traced in.

Tracing freezes ``self.training``: ``F.dropout(x, p, self.training)`` is recorded with
``training=True``, and ``p if self.training else 0.0`` (transformers' attention) keeps the
branch it took. A graph traced in training mode and then run after ``model.eval()`` would
keep dropping activations, silently. So ``trace_module`` traces a second time in the other
mode: where the generated code differs, the graph depends on the mode, and a forward
pre-hook (:class:`TrainingModeGuard`) refuses to run it in the mode it was not traced in.
Graphs that read no mode, or only as dropout with ``p=0`` (LLaMA's attention), get no guard.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Dict, Iterator, List, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ...errors import TraceError

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
            f"{self.where}: this graph was traced in {traced} mode and depends on the mode (dropout or a branch on "
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
    """Give every graph of ``gm`` (``module`` traced in its current mode) that differs when traced in the
    other mode a :class:`TrainingModeGuard`. ``trace_again`` traces ``module`` once more, as ``gm`` was."""
    traced_training = module.training
    codes = _graph_codes(gm)
    try:
        with _flipped_mode(module):
            other = _graph_codes(trace_again())
    except Exception as e:  # the other mode does not even trace: this graph can only serve the traced one
        logger.debug("%s: tracing in %s mode failed (%s); the graph is kept to %s mode", where,
                     _mode(not traced_training), e, _mode(traced_training))
        other = {}
    for name, code in codes.items():
        if other.get(name) == code:
            continue
        graph_module = gm.get_submodule(name) if name else gm
        if _has_guard(graph_module):  # retraced: the graph it came from was fixed to a mode already
            continue
        path = ".".join(p for p in (where if where != "<root>" else "", name) if p) or "<root>"
        graph_module.register_forward_pre_hook(TrainingModeGuard(path, traced_training))
        logger.debug("%s: the traced graph depends on the training mode; it runs only in %s mode", path,
                     _mode(traced_training))

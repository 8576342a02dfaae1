"""Shapes from example inputs: the graph runs once on fake tensors and each node notes its value.

``horizontal_fuse(gm, example_inputs=[...])`` calls :func:`note_example_values` on its private
copy of the graph, so that the rules know every node's shape (``node.meta[EXAMPLE_META]``,
read by :func:`~schedlang.graph.passes._nodes.tensor_shape`). Only the shapes and dtypes of
the examples count: they become fake tensors (``FakeTensorMode``) on the module's device, so
nothing is computed and no memory is taken for activations.

The notes are removed (:func:`forget_example_values`) before the graph is installed: a later
step (a shard, say) may change shapes, and a stale note would mislead a later run of the rules.
"""

from __future__ import annotations

from typing import Any, Sequence, Tuple

import torch
from torch import fx

from ...errors import SchedlangError, ScheduleTypeError, ScheduleValueError
from ..tracer.common import module_device
from ._nodes import EXAMPLE_META

__all__ = ["check_example_inputs", "describe_examples", "note_example_values", "forget_example_values"]


def describe_examples(examples: Sequence[Any]) -> str:
    """``[(7, 91) float32, (7,) int64]``: the shapes and dtypes of example tensors, for messages and plans."""
    parts = []
    for t in examples:
        if isinstance(t, torch.Tensor):
            parts.append(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}")
        else:
            parts.append(type(t).__name__)
    return "[" + ", ".join(parts) + "]"


def _inputs(gm: fx.GraphModule):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def check_example_inputs(gm: fx.GraphModule, example_inputs: Any, where: str) -> Tuple[torch.Tensor, ...]:
    """``example_inputs`` as meta tensors (shape and dtype only), after checking that they fit ``gm``'s inputs.

    Raises ScheduleTypeError for anything but a list of tensors, ScheduleValueError for the
    wrong number of them; both name ``where`` and the inputs of the traced forward.
    """
    inputs = _inputs(gm)
    names = ", ".join(n.target for n in inputs) or "no inputs"
    if not isinstance(example_inputs, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in example_inputs):
        got = describe_examples(example_inputs) if isinstance(example_inputs, (list, tuple)) else \
            type(example_inputs).__name__
        raise ScheduleTypeError(f"{where}: horizontal_fuse example_inputs must be a list of tensors, one per input "
                                f"of the traced forward ({names}), got {got}")
    variadic = any(n.target.startswith("*") for n in inputs)
    required = [n for n in inputs if not n.args and not n.target.startswith("*")]
    if len(example_inputs) < len(required) or (not variadic and len(example_inputs) > len(inputs)):
        expected = f"{len(required)}" if len(required) == len(inputs) else f"{len(required)} to {len(inputs)}"
        raise ScheduleValueError(f"{where}: horizontal_fuse example_inputs has {len(example_inputs)} tensor(s), but "
                                 f"the traced forward takes {expected} ({names}); pass one tensor per input")
    return tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in example_inputs)


class _Recorder(fx.Interpreter):
    """Runs a graph and notes, on each node, the tensor it produced."""

    current: Any = None

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        result = super().run_node(n)
        if isinstance(result, torch.Tensor):
            n.meta[EXAMPLE_META] = result
        return result


def note_example_values(gm: fx.GraphModule, graph: fx.Graph, example_inputs: Sequence[torch.Tensor],
                        where: str) -> None:
    """Run ``graph`` (a copy of ``gm.graph``, with ``gm``'s modules) on fake tensors shaped like
    ``example_inputs`` and note each node's value; ScheduleValueError (naming ``where``) if it fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..tracer.examples import _shape_only_syncs

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # parameters become fake as they are used
    device = module_device(gm)
    with fake_mode:
        args = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in example_inputs]
    recorder = _Recorder(gm, graph=graph)
    try:
        with fake_mode, _shape_only_syncs():  # a sync point gives its output shape, without a collective
            recorder.run(*args)
    except SchedlangError:
        forget_example_values(graph)
        raise
    except Exception as e:
        forget_example_values(graph)
        names = ", ".join(n.target for n in graph.nodes if n.op == "placeholder") or "no inputs"
        at = f" at node '{recorder.current.name}'" if recorder.current is not None else ""
        cause = (str(e).strip().splitlines() or [""])[0]  # the Interpreter appends the node's code on more lines
        raise ScheduleValueError(f"{where}: horizontal_fuse cannot run the traced graph on example_inputs "
                                 f"{describe_examples(example_inputs)}{at}: {type(e).__name__}: {cause}; pass "
                                 f"tensors shaped as in a real call of forward ({names})") from e


def forget_example_values(graph: fx.Graph) -> None:
    """Remove the notes :func:`note_example_values` made."""
    for n in graph.nodes:
        n.meta.pop(EXAMPLE_META, None)

"""The base of schedlang's Inductor graph passes (``joint_custom_post_pass``, ``pre_grad_custom_pass``, ...)."""

from __future__ import annotations

from typing import Hashable

#: the node hint Inductor's lowering reads (``GraphLowering.run_node``): compute the node into a buffer of its
#: own, with the strides it has in the graph, instead of inlining it into each reader's kernel
REALIZE_HINT = "inductor_realize_to_strides"


def _custom_graph_pass_base():
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # an Inductor without custom passes: a plain callable
        return object
    return CustomGraphPass


class InductorPass(_custom_graph_pass_base()):
    """A pass named by ``NAME`` and ``VERSION``.

    ``uuid`` gives both, so Inductor's FX-graph cache keeps serving compiled graphs (a custom pass without
    one turns the cache off) and a new version invalidates them. Instances of a pass compare equal:
    torch.compile tells backends apart by their options, and the layers of a model share one compiled
    graph only if their options are equal (else each layer counts as a recompile and, past the limit,
    runs eagerly)."""

    NAME = "pass"
    VERSION = 1

    def uuid(self) -> Hashable:
        return f"schedlang.{self.NAME}.v{self.VERSION}"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.uuid() == self.uuid()

    def __hash__(self) -> int:
        return hash(self.uuid())


class InductorPasses(InductorPass):
    """Several passes run in order where Inductor takes one (``post_grad_custom_post_pass`` holds a single
    callable). Its ``uuid`` names every pass in it, so two sequences are equal when they run the same passes
    in the same order.

    Example::

        InductorPasses(SharedScaledMMOperandPass(), Float8ScaleOncePass())
    """

    def __init__(self, *passes: InductorPass) -> None:
        self.passes = tuple(passes)

    def uuid(self) -> Hashable:
        return "+".join(str(p.uuid()) for p in self.passes)

    def __call__(self, graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

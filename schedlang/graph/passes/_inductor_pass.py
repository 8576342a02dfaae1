"""The base of schedlang's Inductor graph passes (``joint_custom_post_pass``, ``pre_grad_custom_pass``, ...)."""

from __future__ import annotations

from typing import Hashable


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
